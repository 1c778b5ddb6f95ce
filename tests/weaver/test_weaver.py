"""Weaver: the untrained adapter is the drafter, the cached batched tree builder against the naive
reference, width-w expansion, the candidate distribution, checkpoints and training."""
import json
import math

import pytest
import torch

from drafttree.costmodel import ConvexCost, VerifyCostModel
from drafttree.policies import caddtree_select, caddtree_select_reference
from drafttree.tree import DraftTree, best_first_nodes
from drafttree.validate import InputError
from drafttree.weaver.checkpoint import WeaverCheckpointError, load_weaver, save_weaver
from drafttree.weaver.model import Weaver, WeaverConfig, candidates_from_logits, drafter_candidates, grouped_topk
from drafttree.weaver.naive import weaver_nodes_reference
from drafttree.weaver.tree import WeaverStream, round_inputs

V, E, HD, D = 97, 24, 20, 6


def make_weaver(trained: bool, seed: int = 0, k: int = 16, layers: int = 2) -> Weaver:
    torch.manual_seed(seed)
    w = Weaver(WeaverConfig(vocab_size=V, embed_size=E, drafter_hidden_size=HD, max_depth=D, hidden_size=32,
                            num_layers=layers, num_heads=4, intermediate_size=40, num_candidates=k)).eval()
    if trained:  # a residual that actually reorders candidates
        with torch.no_grad():
            w.readout.weight.normal_(0, 0.4)
    return w


def make_round(weaver: Weaver, seed: int = 0, depth: int = D, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, E, generator=g)
    logits = torch.randn(depth, V, generator=g) * scale
    hidden = torch.randn(depth, HD, generator=g)
    return logits, round_inputs(weaver, logits, hidden, lambda ids: table[ids])


def rows(nodes):
    return [(n.parent, n.token, n.depth) for n in nodes]


def token_paths(nodes) -> set:
    paths = [()]
    for n in nodes:
        paths.append(paths[n.parent] + (n.token,))
    return set(paths[1:])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_untrained_weaver_builds_exactly_the_ddtree_tree(seed, budget):
    weaver = make_weaver(trained=False, seed=seed)
    logits, inputs = make_round(weaver, seed)
    with torch.no_grad():
        ours = list(WeaverStream(weaver, inputs, 3, budget, width=1))
    ddtree = list(best_first_nodes(logits.log_softmax(-1), budget))
    assert rows(ours) == rows(ddtree)
    assert [n.path_logprob for n in ours] == [n.path_logprob for n in ddtree]  # bit for bit
    assert [n.logprob for n in ours] == [n.logprob for n in ddtree]


@pytest.mark.parametrize("seed", range(3))
def test_batched_cached_stream_matches_the_naive_reference(seed):
    weaver = make_weaver(trained=True, seed=seed)
    _, inputs = make_round(weaver, seed)
    with torch.no_grad():
        fast = list(WeaverStream(weaver, inputs, 7, 40, width=1))
        ref = weaver_nodes_reference(weaver, inputs, 7, 40)
    assert rows(fast) == rows(ref)
    assert max(abs(a.path_logprob - b.path_logprob) for a, b in zip(fast, ref)) < 1e-4
    assert rows(fast) != rows(list(best_first_nodes(make_round(weaver, seed)[0].log_softmax(-1), 40)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("width", [4, 8])
def test_lookahead_stream_is_exact_best_first_with_fewer_calls(seed, width):
    from drafttree.weaver.tree import LookaheadWeaverStream

    weaver = make_weaver(trained=True, seed=seed)
    _, inputs = make_round(weaver, seed)
    with torch.no_grad():
        exact = WeaverStream(weaver, inputs, 0, 64, 1)
        ahead = LookaheadWeaverStream(weaver, inputs, 0, 64, width)
        assert rows(list(ahead)) == rows(list(exact))
        assert ahead.calls < 0.7 * exact.calls
        assert rows(list(LookaheadWeaverStream(weaver, inputs, 0, 30, 1))) == rows(list(exact))[:30]


def test_first_scored_depth_keeps_the_drafters_marginals_at_the_root():
    weaver = make_weaver(trained=True, seed=0)
    weaver.config.first_scored_depth = 1
    logits, inputs = make_round(weaver, 0)
    with torch.no_grad():
        nodes = list(WeaverStream(weaver, inputs, 3, 30, 1))
        ref = weaver_nodes_reference(weaver, inputs, 3, 30)
    ddtree = {(n.token, n.logprob) for n in best_first_nodes(logits.log_softmax(-1), 30) if n.depth == 1}
    assert {(n.token, n.logprob) for n in nodes if n.depth == 1} <= ddtree
    assert rows(nodes) == rows(ref)


@pytest.mark.parametrize("width", [2, 8])
def test_width_w_expansion(width):
    weaver = make_weaver(trained=True, seed=1)
    _, inputs = make_round(weaver, 1)
    with torch.no_grad():
        stream = WeaverStream(weaver, inputs, 0, 64, width)
        nodes = list(stream)
        exact = WeaverStream(weaver, inputs, 0, 64, 1)
        exact_nodes = list(exact)
    assert len(nodes) == 64
    tree = DraftTree.from_nodes(0, nodes)  # valid: parents first, distinct siblings
    assert int(tree.depths.max()) <= D
    # root + one per node at most (nodes at the last depth have no children to score)
    assert stream.calls <= 1 + math.ceil(64 / width) and stream.calls < exact.calls <= 64
    # the same probabilities, popped a little out of order: most nodes are shared with exact best-first
    assert len(token_paths(nodes) & token_paths(exact_nodes)) >= 0.75 * 64
    # a consumer that stops early pays for no more calls than it saw
    with torch.no_grad():
        lazy = WeaverStream(weaver, inputs, 0, 64, width)
        first = [n for _, n in zip(range(width), lazy)]
    assert len(first) == width and lazy.calls == 1


def test_candidate_distribution_is_normalised_and_exact_when_untrained():
    weaver = make_weaver(trained=False)
    g = torch.Generator().manual_seed(0)
    lp_full = (torch.randn(5, V, generator=g) * 4).log_softmax(-1)
    ids, lp, log_rest = drafter_candidates(lp_full, 16)
    s = torch.randn(5, 32, generator=g)
    emb = torch.randn(5, 16, E, generator=g)
    out = weaver.candidate_logprobs(s, lp, log_rest, emb)
    assert torch.equal(out[:, :-1], lp) and torch.equal(out[:, -1], log_rest)
    trained = make_weaver(trained=True)
    for scale in (1.0, 50.0):  # large residuals: the logsumexp branch
        out = trained.candidate_logprobs(s * scale, lp, log_rest, emb * scale)
        assert torch.allclose(out.logsumexp(-1), torch.zeros(5), atol=1e-4)
    a, b = candidates_from_logits(lp_full * 1.3, 16), drafter_candidates((lp_full * 1.3).log_softmax(-1), 16)
    assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], atol=1e-5)
    x = torch.randn(3, 4, 1000, generator=g)
    assert all(torch.equal(p, q) for p, q in zip(grouped_topk(x, 8, group=32), torch.topk(x, 8)))


def test_reduced_draft_vocabulary_candidates_are_target_ids():
    weaver = make_weaver(trained=True)
    g = torch.Generator().manual_seed(0)
    vocab_ids = torch.randperm(V, generator=g)[:30].sort().values
    table = torch.randn(V, E, generator=g)
    inputs = round_inputs(weaver, torch.randn(D, 30, generator=g), torch.randn(D, HD, generator=g),
                          lambda i: table[i], vocab_ids)
    with torch.no_grad():
        nodes = list(WeaverStream(weaver, inputs, 0, 20, 4))
    assert {n.token for n in nodes} <= set(vocab_ids.tolist())


def test_caddtree_select_with_a_per_node_cost_matches_brute_force():
    model = VerifyCostModel(context_lens=[0], curves=[ConvexCost((1.0, 8.0, 64.0), (10.0, 12.0, 40.0))], draft_ms=3.0)
    probs = sorted(torch.rand(40, generator=torch.Generator().manual_seed(0)).tolist(), reverse=True)
    from drafttree.tree import TreeNode

    stream = [TreeNode(0, i, 1, math.log(p), math.log(p)) for i, p in enumerate(probs)]
    for node_ms in (0.0, 0.2, 1.5):
        sel = caddtree_select(iter(stream), model, 0, 40, overhead_ms=0.5, node_ms=node_ms)
        assert len(sel.nodes) == caddtree_select_reference(probs, model, 0, 40, overhead_ms=0.5, node_ms=node_ms)
    assert len(caddtree_select(iter(stream), model, 0, 40, node_ms=1.5).nodes) < len(
        caddtree_select(iter(stream), model, 0, 40).nodes)


def test_checkpoint_round_trip_and_strict_loading(tmp_path):
    weaver = make_weaver(trained=True, layers=1)
    save_weaver(weaver, tmp_path / "w")
    back = load_weaver(tmp_path / "w")
    assert back.config == weaver.config
    for (n, a), (_, b) in zip(weaver.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    (tmp_path / "w" / "config.json").write_text(json.dumps({**cfg, "num_layers": 2}))
    with pytest.raises(WeaverCheckpointError, match="missing"):
        load_weaver(tmp_path / "w")
    (tmp_path / "w" / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    with pytest.raises(WeaverCheckpointError, match="shape mismatches"):
        load_weaver(tmp_path / "w")
    (tmp_path / "w" / "config.json").write_text(json.dumps({**cfg, "format": "something-else"}))
    with pytest.raises(WeaverCheckpointError, match="not a Weaver config"):
        load_weaver(tmp_path / "w")
    (tmp_path / "w" / "config.json").write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        load_weaver(tmp_path / "w")
    with pytest.raises(WeaverCheckpointError, match="no config.json"):
        load_weaver(tmp_path / "missing")
    (tmp_path / "w" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "w" / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(WeaverCheckpointError, match="unreadable"):
        load_weaver(tmp_path / "w")


def test_training_lowers_the_loss_resumes_identically_and_the_cli_runs(tmp_path):
    from drafter_helpers import synthetic, tiny_cfg

    from drafttree.drafter.checkpoint import save_drafter
    from drafttree.drafter.model import DFlashDrafter
    from drafttree.training.weaver_train import WeaverTrainConfig, main, train_weaver

    data, target, embed = synthetic(tmp_path)
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_cfg()).eval()
    tc = dict(steps=30, seqs_per_step=2, blocks_per_seq=6, lr=3e-3, warmup_steps=3, log_every=5, checkpoint_every=10,
              hidden_size=32, num_heads=4, intermediate_size=48, num_candidates=16, val_sequences=4)
    res = train_weaver(data, tmp_path / "run", drafter, embed, embed, WeaverTrainConfig(**tc), progress=False, bf16=False)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["held_out"][-1]["loss"] < 0.8 * m["held_out"][0]["loss"], (m["held_out"][0], m["held_out"][-1])
    assert m["held_out"][0]["tau_weaver"] == m["held_out"][0]["tau_drafter"]  # untrained = the drafter
    assert len(m["train"][-1]["weaver_top1"]) == 3
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "accuracy.png").exists()
    assert res["final"]["step"] == 30

    # interrupted at step 12 and resumed: bit-identical weights
    train_weaver(data, tmp_path / "split", drafter, embed, embed, WeaverTrainConfig(**tc, stop_at=12), progress=False,
                 bf16=False)
    assert json.loads((tmp_path / "split" / "checkpoint" / "trainer_state.json").read_text())["step"] == 12
    resumed = train_weaver(data, tmp_path / "split", drafter, embed, embed, WeaverTrainConfig(**tc), progress=False,
                           bf16=False)["weaver"]
    for (n, a), (_, b) in zip(res["weaver"].state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n

    save_drafter(drafter, tmp_path / "drafter")
    assert main(["--data", str(data), "--target", str(target), "--drafter", str(tmp_path / "drafter"), "--out",
                 str(tmp_path / "cli"), "--steps", "3", "--seqs-per-step", "1", "--hidden-size", "16", "--num-heads", "2",
                 "--intermediate-size", "16", "--num-candidates", "8", "--threads", "1", "--bf16", "off"]) == 0
    assert load_weaver(tmp_path / "cli" / "weaver").config.num_candidates == 8
    with pytest.raises(InputError, match="--steps"):
        main(["--data", str(data), "--out", str(tmp_path / "x"), "--steps", "0"])


def test_training_with_a_reduced_draft_vocabulary_uses_its_candidates(tmp_path):
    from drafter_helpers import synthetic, tiny_cfg

    from drafttree.training.data import FeatureDataset
    from drafttree.drafter.model import DFlashDrafter
    from drafttree.training.train import BlockForward, build_batch
    from drafttree.training.weaver_train import WeaverTrainConfig, teacher_forced, train_weaver

    data, _, embed = synthetic(tmp_path)
    torch.manual_seed(0)
    drafter = DFlashDrafter(tiny_cfg(draft_vocab_size=40)).eval()
    drafter.set_draft_vocab(torch.arange(0, 64, 64 / 40).long()[:40])
    tc = WeaverTrainConfig(steps=3, seqs_per_step=2, blocks_per_seq=4, hidden_size=16, num_heads=2, intermediate_size=16,
                           num_candidates=8, val_sequences=2, log_every=1, checkpoint_every=3)
    weaver = train_weaver(data, tmp_path / "run", drafter, embed, embed, tc, progress=False, bf16=False)["weaver"]
    batch = build_batch([FeatureDataset(data)[0]], drafter.config, 4, torch.Generator().manual_seed(0), 7.0)
    with torch.no_grad():
        _, _, ids = teacher_forced(weaver, BlockForward(drafter, embed), batch, embed, drafter.head_weight(embed),
                                   drafter.config.block_size, drafter.draft_vocab)
    assert set(ids.flatten().tolist()) <= set(drafter.draft_vocab.tolist())
