"""The hybrid targets (qwen3_5, qwen3_next) on the quantized paths (issue 38 item 2): the module swap leaves no
float linear layer and the GDN state in fp32, the kernels give their references' logits inside the hybrid, tree
verify matches one-token steps, and greedy speculation equals AR for every method."""
import math

import pytest
import torch

from drafttree.costmodel import VerifyCostModel
from drafttree.engine import generate_ar, run_to_end
from drafttree.load import load_target
from drafttree.methods import Decoder
from drafttree.model.hybrid import HybridModel
from drafttree.model.linear import Int8Linear, Q4Linear
from drafttree.profile import profile_costs
from spec_helpers import REGIMES, assert_every_method_equals_ar, random_drafter_for, repetitive_prompts, weaver_for
from runtime_helpers import random_tree_parents, tree_and_step_logits

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

VOCAB = 96
# every linear's input width a multiple of 32, so that each one can take Q4_1 blocks
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid_checkpoint(request, tmp_path_factory):
    torch.manual_seed(3)
    if request.param == "qwen3_next":
        hf = Qwen3NextForCausalLM(Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32, mlp_only_layers=[2]))
    else:
        hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))
    with torch.no_grad():  # large random weights: well-separated argmax decisions (as tiny_models does)
        for name, p in hf.named_parameters():
            if p.ndim > 1 and "conv" not in name:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


def set_linear_isa(model, isa: str) -> None:
    for m in model.modules():
        if isinstance(m, (Int8Linear, Q4Linear)):
            m.isa = isa


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_every_linear_is_quantized_and_the_gdn_state_stays_fp32(hybrid_checkpoint, compute):
    m = load_target(str(hybrid_checkpoint), compute=compute).model
    assert isinstance(m, HybridModel) and m.attention_kernel is not None
    assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
    assert isinstance(m.lm_head, Int8Linear)  # int8 on both paths (a reduced draft vocabulary slices its rows)
    for gdn in m.gdn_layers():
        kind = Q4Linear if compute == "q4" else Int8Linear
        assert isinstance(gdn.in_proj, kind) and isinstance(gdn.out_proj, kind)
    st = m.new_state(32)
    m.prefill(st, torch.arange(5))
    assert all(s.recurrent.dtype == torch.float32 and s.conv_ctx.dtype == torch.float32 for s in st.gdn)
    # a one-token forward (AR, a one-node tree) runs the C++ GDN step (ops/gdn/step.py) on these paths
    from drafttree.ops.gdn.step import step_available

    m.forward(st, torch.tensor([7]))
    assert all(gdn.kernel_isa is not None for gdn in m.gdn_layers())
    assert all(s.pending.step is not None for s in st.gdn) == step_available()
    m.commit(st, torch.tensor([0]))
    assert all(s.recurrent.dtype == torch.float32 and s.conv_ctx.dtype == torch.float32 for s in st.gdn)


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_kernel_hybrid_equals_reference_hybrid(hybrid_checkpoint, compute):
    """The C++ linear kernels against their plain-PyTorch references, inside the hybrid: the int8 reference is
    exact integer arithmetic (the same bits); the Q4_1 reference sums in float64, the kernel in fp32."""
    fast = load_target(str(hybrid_checkpoint), compute=compute).model
    ref = load_target(str(hybrid_checkpoint), compute=compute).model
    set_linear_isa(ref, "reference")
    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(2))
    logits = [m.forward(m.new_state(64), ids).logits for m in (fast, ref)]
    if compute == "int8":
        assert torch.equal(*logits)
    else:
        torch.testing.assert_close(logits[0], logits[1], atol=1e-3 * float(logits[1].abs().max()), rtol=0)
        assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_tree_logits_match_one_token_steps(hybrid_checkpoint, compute):
    """Each node of a tree verify against one-token steps along its path. Attention and the linear kernels are
    batch-invariant, but the GDN layers fold a path into their fp32 state in another order than the one-token
    recurrence: the logits agree to rounding (~1e-6), except where that rounding moves a later layer's int8
    activation (or a MoE router's top-k) across a step, which moves the node's logits by up to a few percent
    (seen: 0.15 of 6.4 on one node in 12). The argmax agrees on every node of these well-separated models;
    bit-for-bit agreement, as on the dense model, is not claimed."""
    m = load_target(str(hybrid_checkpoint), compute=compute).model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (9,), generator=gen)
    parents = random_tree_parents(12, gen)
    tokens = torch.randint(0, VOCAB, (12,), generator=gen)
    tree, steps = tree_and_step_logits(m, prompt, parents, tokens)
    close = 0
    for i, step in enumerate(steps):
        scale = float(step.abs().max())
        close += bool((step - tree[i]).abs().max() <= 1e-5 * scale)
        assert (step - tree[i]).abs().max() <= 0.05 * scale, f"node {i}"
        assert int(step.argmax()) == int(tree[i].argmax()), f"node {i}"
    assert close >= 10  # a rounding flip is the exception


@pytest.mark.parametrize("compute", ["q4", "int8"])
def test_every_method_equals_ar_on_the_quantized_hybrid(hybrid_checkpoint, compute):
    target = load_target(str(hybrid_checkpoint), compute=compute)
    drafter = random_drafter_for(target.model)
    decoder = Decoder(target, drafter=drafter, budget=6, max_tree_nodes=24, cost_model=REGIMES["cheap-draft"],
                      weaver=weaver_for(target, drafter))
    g = torch.Generator().manual_seed(5)
    for ids in repetitive_prompts(VOCAB, 3, seed=4):
        assert_every_method_equals_ar(target, decoder, ids, int(torch.randint(8, 33, (1,), generator=g)), compute)


def test_the_cost_model_profiles_the_quantized_hybrid(hybrid_checkpoint):
    """`drafttree profile` on a hybrid: the verify forwards (GDN tree solve included) and the drafter's round are
    timed like a dense target's, the curves are convex and increasing, the model survives a save/load, and CaDDTree
    sized by it stays lossless."""
    target = load_target(str(hybrid_checkpoint), compute="q4")
    drafter = random_drafter_for(target.model)
    cm = profile_costs(target, drafter, quick=True, repeats=1, progress=False, token_counts=(1, 2, 4, 8),
                       context_lens=(16, 48))
    assert list(cm.context_lens) == [16, 48] and cm.draft_ms > 0
    for ctx in cm.context_lens:
        ms = [cm.verify_ms_for_tokens(n, ctx) for n in (1, 2, 4, 8)]
        assert all(math.isfinite(v) and v > 0 for v in ms) and ms == sorted(ms)
    assert VerifyCostModel.from_dict(cm.to_dict()).to_dict() == cm.to_dict()
    decoder = Decoder(target, drafter=drafter, max_tree_nodes=24, cost_model=cm)
    for ids in repetitive_prompts(VOCAB, 2, seed=6):
        ar = generate_ar(target, ids, 16, stop_token_ids=()).tokens
        for method in ("caddtree", "caddtree-online"):
            assert run_to_end(decoder.sequence(method, ids, max_new_tokens=16, stop_token_ids=())).tokens == ar


def test_zero_centered_norm_kernel_matches_its_reference():
    """The (1 + w) RMSNorm through the C++ rms_norm (kernel paths) against the PyTorch form it replaces."""
    from drafttree.model.hybrid_blocks import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(5, 3, 96)
    ref = norm(x)
    norm.kernel_isa = "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "scalar"
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-6)
