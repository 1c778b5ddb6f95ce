"""Hybrid qwen3_next / qwen3_5 targets: loading, logits vs transformers, tree verify vs sequential,
AR greedy vs generate(), and greedy tree speculation == AR greedy (all fp32, tiny random models)."""
import json

import pytest
import torch

from drafttree.engine import generate_ar
from drafttree.load import load_target
from drafttree.model.hybrid import HybridModel
from drafttree.tree import DraftTree
from drafttree.verify import accept_greedy

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.08,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)


def _make(family: str, tmp_path_factory):
    torch.manual_seed(0 if family == "qwen3_next" else 1)
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                              shared_expert_intermediate_size=32, mlp_only_layers=[2])
        hf = Qwen3NextForCausalLM(cfg)
    else:
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))
    with torch.no_grad():  # exercise the (1 + w) / w norm conventions with non-trivial weights
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.eval()
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    return hf, load_target(str(path)), path


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def pair(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(ids)[None]).logits[0]


def test_loads_as_hybrid(pair):
    _, target, _ = pair
    assert isinstance(target.model, HybridModel)
    assert len(target.model.gdn_layers()) == 3


@pytest.mark.parametrize("T", [11, 90])  # 90 > CHAIN_SOLVE_MAX: the chunked prefill path
def test_prefill_logits_match_transformers(pair, T):
    hf, target, _ = pair
    m = target.model
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(T))
    st = m.new_state(128)
    out = m.forward(st, ids).logits
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    # commit a partial prefix of a long chain, then continue: equals the full-sequence forward
    a = T - 5
    m.commit(st, torch.arange(a))
    out2 = m.forward(st, ids[a:]).logits
    torch.testing.assert_close(out2, ref[a:], atol=1e-4, rtol=0)


def test_token_by_token_decode_matches_transformers(pair):
    hf, target, _ = pair
    m = target.model
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    st = m.new_state(64)
    m.prefill(st, ids[:4])
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids[None, :4], past_key_values=cache, use_cache=True)
        for t in range(4, 12):  # single-token cached steps are transformers' known-good path
            ref = hf(ids[None, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
            ours = m.forward(st, ids[t:t + 1]).logits[-1]
            m.commit(st, torch.tensor([0]))
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["fold", "replay", "deferred"])
def test_tree_rounds_match_sequential(pair, mode):
    """Every node's logits == transformers' full-sequence forward over committed + path(node); three
    rounds accepting the root only, an interior node and the deepest leaf."""
    hf, target, _ = pair
    m = target.model
    gen = torch.Generator().manual_seed(7)
    st = m.new_state(128)
    m.defer_gdn_commit = mode == "deferred"
    for g in m.gdn_layers():
        g.use_replay = mode == "replay"
    try:
        committed = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
        m.prefill(st, torch.tensor(committed))
        for pick in ("root", "interior", "deepest"):
            from drafttree.tree import random_tree

            tree = random_tree(14, VOCAB, shape="random", generator=gen, root_token=int(torch.randint(0, VOCAB, (1,), generator=gen)))
            out = m.forward(st, tree.tokens, positions=tree.positions(st.length), tree_mask=tree.ancestor_mask).logits
            for i in range(tree.num_nodes):
                seq = committed + tree.tokens[tree.path(i)].tolist()
                torch.testing.assert_close(out[i], _hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)
            depths = tree.depths
            if pick == "root":
                node = 0
            elif pick == "interior":
                node = next(i for i in range(1, tree.num_nodes) if tree.children(i))
            else:
                node = int(depths.argmax())
            path = tree.path(node)
            m.commit(st, path)
            committed += tree.tokens[path].tolist()
            assert st.length == len(committed)
        # a final chain forward after the rounds
        nxt = torch.randint(0, VOCAB, (3,), generator=gen)
        out = m.forward(st, nxt).logits
        torch.testing.assert_close(out, _hf_logits(hf, committed + nxt.tolist())[-3:], atol=1e-4, rtol=0)
    finally:
        m.defer_gdn_commit = False
        for g in m.gdn_layers():
            g.use_replay = False


def test_ar_greedy_matches_generate(pair):
    hf, target, _ = pair
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(11))
    ours = generate_ar(target, prompt, max_new_tokens=24, stop_token_ids=()).tokens
    with torch.no_grad():
        ref = hf.generate(prompt[None], do_sample=False, max_new_tokens=24, min_new_tokens=24,
                          pad_token_id=0, eos_token_id=None)[0, 7:].tolist()
    assert ours == ref


def _planted_tree(root: int, truth: list[int], n: int, gen: torch.Generator) -> DraftTree:
    """A random tree whose first branch follows the true continuation for a random length."""
    parents, tokens, kids = [-1], [root], [set()]
    for j in range(int(torch.randint(0, min(len(truth), 6) + 1, (1,), generator=gen))):
        parents.append(len(tokens) - 1)
        tokens.append(truth[j])
        kids[-1].add(truth[j])
        kids.append(set())
    while len(tokens) < n:
        p = int(torch.randint(0, len(tokens), (1,), generator=gen))
        tok = int(torch.randint(0, VOCAB, (1,), generator=gen))
        if tok in kids[p]:
            continue
        kids[p].add(tok)
        parents.append(p)
        tokens.append(tok)
        kids.append(set())
    return DraftTree.from_parents(tokens, parents)


def test_greedy_tree_speculation_equals_ar(pair):
    _, target, _ = pair
    m = target.model
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(13))
    max_new = 30
    truth = generate_ar(target, prompt, max_new_tokens=max_new, stop_token_ids=()).tokens
    gen = torch.Generator().manual_seed(17)
    st = m.new_state(prompt.numel() + max_new + 20)
    tok = int(m.prefill(st, prompt).logits[-1].argmax())
    out, accepted = [tok], 0
    while len(out) < max_new:
        tree = _planted_tree(tok, truth[len(out):], 12, gen)
        logits = m.forward(st, tree.tokens, positions=tree.positions(st.length), tree_mask=tree.ancestor_mask).logits
        acc = accept_greedy(tree, logits.argmax(-1))
        m.commit(st, acc.nodes)
        out += acc.committed_tokens(tree).tolist()
        accepted += acc.num_accepted_drafts
        tok = acc.bonus_token
    assert out[:max_new] == truth
    assert accepted > 0  # the planted branches were actually used


def test_commit_must_be_a_root_to_node_path(pair):
    _, target, _ = pair
    m = target.model
    st = m.new_state(32)
    m.prefill(st, torch.tensor([1, 2, 3]))
    tree = DraftTree.from_parents([4, 5, 6, 7], [-1, 0, 0, 1])
    m.forward(st, tree.tokens, tree_mask=tree.ancestor_mask)
    with pytest.raises(ValueError, match="root-to-node path"):
        m.commit(st, torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="ancestor mask"):
        bad = tree.ancestor_mask.clone()
        bad[3, 2] = True
        m.forward(st, tree.tokens, tree_mask=bad)


def test_unsupported_config_is_a_clear_error(tmp_path):
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**COMMON, "num_hidden_layers": 1, "layer_types": ["linear_attention"]}))
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act"):
        load_target(str(tmp_path))


@pytest.mark.parametrize("policy", ["chain", "ddtree", "caddtree"])
def test_engine_speculative_methods_equal_ar(pair, policy):
    """Every decoding method of the engine decodes hybrid targets losslessly (fp32 greedy)."""
    from drafttree.engine import generate_speculative
    from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy, DFlashProposer
    from spec_helpers import TargetCopyProposer, random_drafter_for
    from spec_helpers import synthetic_cost_model

    _, target, path = pair
    make = {"chain": ChainPolicy, "ddtree": lambda: BestFirstPolicy(12),
            "caddtree": lambda: CostAwarePolicy(synthetic_cost_model(), 32)}[policy]
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
    truth = generate_ar(target, prompt, max_new_tokens=30, stop_token_ids=()).tokens
    for proposer in (TargetCopyProposer(path, make(), noise=2.0),
                     DFlashProposer(random_drafter_for(target.model), target.model, make())):
        assert generate_speculative(target, prompt, proposer, max_new_tokens=30, stop_token_ids=()).tokens == truth


def test_interleaved_hybrid_sequences_equal_each_alone(pair):
    """GDN recurrent/conv state and KV rows live per request: interleaved rounds change nothing."""
    from drafttree.engine import Sequence
    from drafttree.proposers import BestFirstPolicy, DFlashProposer
    from spec_helpers import random_drafter_for

    _, target, _ = pair
    proposer = DFlashProposer(random_drafter_for(target.model), target.model, BestFirstPolicy(8))
    gen = torch.Generator().manual_seed(21)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 9, 7)]
    truth = [generate_ar(target, p, max_new_tokens=20, stop_token_ids=()).tokens for p in ids]
    seqs = [Sequence(target, p, proposer if i else None, 20, stop_token_ids=()) for i, p in enumerate(ids)]
    while any(not s.done for s in seqs):
        for s in seqs[::-1]:
            s.step()
    assert [s.tokens for s in seqs] == truth
