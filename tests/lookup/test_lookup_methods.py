"""The lookup methods by name: registered in drafttree.methods (generate, Decoder, the server), run by
`drafttree bench` beside the others, and the copy set selectable there."""
import pytest
import torch

from drafttree.load import load_target
from drafttree.lookup import LookupDFlashProposer
from spec_helpers import random_drafter_for, synthetic_cost_model



def repetitive_prompts(vocab, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).repeat(3)
            for _ in range(n)]


def test_methods_are_registered(tiny_checkpoint):
    from drafttree.methods import COST_AWARE, METHODS, NO_DRAFTER, Decoder, generate, make_proposer

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    assert {"lookup", "lookup-ddtree", "lookup-caddtree", "lookup-caddtree-online"} <= set(METHODS)
    assert {"lookup-caddtree", "lookup-caddtree-online"} <= set(COST_AWARE) and "lookup" in NO_DRAFTER
    # no drafter ships for the tiny model: `lookup` must not ask for one
    assert make_proposer("lookup", target, budget=5).max_nodes == 5
    assert Decoder(target, budget=7).proposer("lookup").name == "lookup"
    drafter = random_drafter_for(target.model)
    dd = make_proposer("lookup-ddtree", target, drafter=drafter, budget=8)
    assert (dd.name, dd.max_nodes, dd.capture_layers) == ("lookup-ddtree", 8, tuple(drafter.config.target_layer_ids))
    decoder = Decoder(target, drafter=drafter, max_tree_nodes=24, cost_model=synthetic_cost_model())
    cadd = decoder.proposer("lookup-caddtree")
    assert (cadd.name, cadd.max_nodes) == ("lookup-caddtree", 24) and cadd.policy.cost_model is decoder.cost_model
    ids = repetitive_prompts(target.model.config.vocab_size, n=1)[0]
    ar = generate("ar", target, ids, 20, stop_token_ids=()).tokens
    online = decoder.proposer("lookup-caddtree-online")  # caddtree-online's recalibration and draft gate inside
    assert online.name == "lookup-caddtree-online" and online.dflash.gate and online.policy.recalibrate
    for method in ("lookup", "lookup-ddtree", "lookup-caddtree", "lookup-caddtree-online"):
        seq = decoder.sequence(method, ids, max_new_tokens=20, stop_token_ids=())
        while not seq.done:
            seq.step()
        assert seq.tokens == ar and seq.stats.method == method
    with pytest.raises(ValueError, match="best-first"):
        LookupDFlashProposer(make_proposer("chain", target, drafter=drafter))



def test_merged_tree_with_follow_depth_equals_ar(tiny_checkpoint):
    """With the policy's follow_depth the drafter's block follows the depth of the nodes the drafter placed (the
    lookup's deep copies do not widen it); the merged method's output is still AR's."""
    from drafttree.methods import Decoder, generate

    path, _ = tiny_checkpoint
    target = load_target(str(path))
    drafter = random_drafter_for(target.model)
    decoder = Decoder(target, drafter=drafter, max_tree_nodes=24, cost_model=synthetic_cost_model())
    proposer = decoder.proposer("lookup-caddtree")
    proposer.dflash.follow_depth = True
    rows = []
    draft_rows = drafter.draft_rows
    drafter.draft_rows = lambda ctx, block, start: rows.append(block.shape[0]) or draft_rows(ctx, block, start)
    for ids in repetitive_prompts(target.model.config.vocab_size, n=2, seed=4):
        ar = generate("ar", target, ids, 24, stop_token_ids=()).tokens
        assert generate("lookup-caddtree", target, ids, 24, proposer=proposer, stop_token_ids=()).tokens == ar
    assert rows and max(rows) <= 1 + proposer.dflash.draft_depth


def test_bench_lists_the_copy_set():
    from drafttree.apps.bench.methods import DEFAULT_DATASETS, parse_datasets

    assert parse_datasets("copy,gsm8k") == ["copy", "gsm8k"] and "copy" not in DEFAULT_DATASETS


def test_bench_runs_the_lookup_methods(tiny_checkpoint, tmp_path):
    from drafttree.apps.bench.methods import benchmark, parse_variants

    assert [v.name for v in parse_variants("lookup,lookup-ddtree,lookup-caddtree", "4,8")] == [
        "ar", "lookup", "lookup-ddtree-4", "lookup-ddtree-8", "lookup-caddtree"]
    path, _ = tiny_checkpoint
    target = load_target(str(path))
    prompts = {"rep": [p.tolist() for p in repetitive_prompts(target.model.config.vocab_size, n=1)]}
    res = benchmark(target, prompts, ["ar", "caddtree", "lookup", "lookup-ddtree", "lookup-caddtree"],
                    drafter=random_drafter_for(target.model), budgets=(8,), max_new_tokens=16,
                    cost_model=synthetic_cost_model(), max_tree_nodes=32, stop_token_ids=(), out_dir=tmp_path,
                    progress=False, warmup_tokens=0)
    rows = res["aggregates"]["rep"]
    assert list(rows) == ["ar", "caddtree", "lookup", "lookup-ddtree-8", "lookup-caddtree"]
    assert all(rows[n]["mismatches"] == 0 and rows[n]["checked"] == 1 for n in list(rows)[1:])
    assert rows["lookup-ddtree-8"]["mean_tree_size"] <= 8
    for f in ("results.md", "tau_vs_budget.png", "caddtree_tree_sizes.png"):
        assert (tmp_path / f).stat().st_size > 0
