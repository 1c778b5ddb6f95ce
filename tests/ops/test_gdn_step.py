"""The one-token GDN step kernel (ops/gdn/step.py) against the layer's composed PyTorch ops (its reference) and an
fp64 oracle (conv + the token-by-token recurrence + gated norm), on every ISA path, over several steps and shapes;
and inside the hybrid layer: the kernel step leaves the committed state alone until the commit swaps it."""
import pytest
import torch

from drafttree.model.gdn_layer import GatedDeltaNet, TreeInfo
from drafttree.model.hybrid_config import HybridConfig
from drafttree.ops.conv import chain_conv_index
from drafttree.ops.gdn import step
from drafttree.ops.gdn.step import gdn_step, gdn_step_reference, step_available
from runtime_helpers import kernel_isas

pytestmark = pytest.mark.skipif(not step_available(), reason="CPU kernels unavailable")


ISAS = kernel_isas("avx512f")


def rel_err(x, ref):
    return float((x.double() - ref.double()).abs().max() / (1 + ref.double().abs().max()))


def layer_config(Hk, Hv, dk, dv, K=4, hidden=32):
    return HybridConfig(
        family="qwen3_5", vocab_size=64, hidden_size=hidden, num_layers=1, layer_types=("linear_attention",),
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=64, num_heads=2, num_kv_heads=1,
        head_dim=16, rotary_dim=16, rope_theta=1e4, attention_bias=False, linear_num_key_heads=Hk,
        linear_num_value_heads=Hv, linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=K,
        intermediate_size=32)


def random_layer(cfg, gen) -> GatedDeltaNet:
    gdn = GatedDeltaNet(cfg)
    with torch.no_grad():
        gdn.in_proj.weight.normal_(0, 0.3, generator=gen)
        gdn.out_proj.weight.normal_(0, 0.3, generator=gen)
        gdn.conv_weight.normal_(0, 0.5, generator=gen)
        gdn.A_log.copy_(torch.empty(cfg.linear_num_value_heads).uniform_(1, 16, generator=gen).log())
        gdn.dt_bias.normal_(0, 1, generator=gen)
        gdn.norm.weight.normal_(1, 0.2, generator=gen)
    return gdn.eval()


def step_args(gdn, st, proj):
    return (proj, gdn.conv_weight, st.conv_ctx, gdn.A_log, gdn.dt_bias, gdn.norm.weight, st.recurrent)


# (Hk, Hv, dk, dv, K): GQA and not, head dims off the vector widths (tails), a short and a long conv
SHAPES = [(2, 2, 16, 16, 4), (2, 4, 16, 16, 4), (1, 3, 8, 24, 2), (2, 4, 20, 36, 3), (4, 8, 32, 128, 4),
          (2, 2, 128, 144, 4), (1, 1, 5, 7, 1)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_step_matches_reference_and_fp64_oracle_over_steps(shape, isa):
    Hk, Hv, dk, dv, K = shape
    gen = torch.Generator().manual_seed(sum(shape))
    gdn = random_layer(layer_config(Hk, Hv, dk, dv, K), gen)
    st = gdn.new_state()
    st.recurrent.normal_(0, 0.5, generator=gen)
    st.conv_ctx.normal_(0, 1, generator=gen)
    ctx64, S64 = st.conv_ctx.double(), st.recurrent.double()
    ctx32, S32 = st.conv_ctx.clone(), st.recurrent.clone()
    params64 = [p.detach().double() for p in (gdn.conv_weight, gdn.A_log, gdn.dt_bias, gdn.norm.weight)]
    width = gdn.in_proj.weight.shape[0]
    for t in range(6):
        proj = torch.randn(1, width, generator=gen) * 2
        before = (ctx32.clone(), S32.clone())
        y, ctx_new, S_new = gdn_step(proj, gdn.conv_weight.detach().t().contiguous(), ctx32, gdn.A_log.detach(),
                                     gdn.dt_bias.detach(), gdn.norm.weight.detach(), S32, Hk, 1e-6, isa)
        assert torch.equal(ctx32, before[0]) and torch.equal(S32, before[1])  # the committed state is only read
        y_ref, ctx_ref, S_ref = gdn_step_reference(proj, gdn.conv_weight.detach(), ctx32, gdn.A_log.detach(),
                                                   gdn.dt_bias.detach(), gdn.norm.weight.detach(), S32, Hk, 1e-6)
        p64 = params64
        y64, ctx64, S64 = gdn_step_reference(proj.double(), p64[0], ctx64, p64[1], p64[2], p64[3], S64, Hk, 1e-6)
        assert y.shape == (1, Hv * dv) and ctx_new.shape == ctx32.shape and S_new.shape == S32.shape
        assert torch.equal(ctx_new, ctx_ref)  # the context shift is a copy
        assert rel_err(y, y64) < 1e-5 and rel_err(S_new, S64) < 1e-5
        assert rel_err(y, y_ref) < 2e-5 and rel_err(S_new, S_ref) < 2e-5
        ctx32, S32 = ctx_new, S_new  # the next step starts from the kernel's own state


def test_isas_agree_at_the_real_head_shape():
    gen = torch.Generator().manual_seed(1)
    gdn = random_layer(layer_config(4, 8, 128, 128), gen)
    st = gdn.new_state()
    st.recurrent.normal_(0, 0.5, generator=gen)
    proj = torch.randn(1, gdn.in_proj.weight.shape[0], generator=gen)
    wt = gdn.conv_weight.detach().t().contiguous()
    outs = {isa: gdn_step(proj, wt, st.conv_ctx, gdn.A_log.detach(), gdn.dt_bias.detach(), gdn.norm.weight.detach(),
                          st.recurrent, 4, 1e-6, isa) for isa in ISAS}
    for isa in ISAS[1:]:
        for a, b in zip(outs[isa], outs["scalar"]):
            assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("isa", ISAS)
def test_layer_kernel_step_equals_composed_path_and_commit_swaps(isa, monkeypatch):
    """GatedDeltaNet.forward of one token: the kernel step (kernel_isa set) against the composed ops
    (step.USE_STEP = False), several steps each committed; an empty commit keeps the state untouched."""
    gen = torch.Generator().manual_seed(7)
    gdn = random_layer(layer_config(2, 4, 16, 32), gen)
    gdn.kernel_isa = isa
    st_k, st_r = gdn.new_state(), gdn.new_state()
    tree = TreeInfo(mask=torch.ones(1, 1, dtype=torch.bool), conv_index=chain_conv_index(1, gdn.K))
    with torch.inference_mode():
        for t in range(5):
            x = torch.randn(1, 32, generator=gen)
            committed = (st_k.conv_ctx, st_k.recurrent.clone())
            out_k = gdn(x, tree if t % 2 else None, st_k)
            assert st_k.pending.step is not None
            assert st_k.conv_ctx is committed[0] and torch.equal(st_k.recurrent, committed[1])
            monkeypatch.setattr(step, "USE_STEP", False)
            out_r = gdn(x, tree if t % 2 else None, st_r)
            monkeypatch.setattr(step, "USE_STEP", True)
            assert st_r.pending.step is None
            assert rel_err(out_k, out_r) < 2e-5
            if t == 2:  # reject the token: the state stays as it was
                gdn.commit(st_k, torch.tensor([], dtype=torch.long))
                gdn.commit(st_r, torch.tensor([], dtype=torch.long))
                assert torch.equal(st_k.recurrent, committed[1])
                continue
            gdn.commit(st_k, torch.tensor([0]))
            gdn.commit(st_r, torch.tensor([0]))
            assert rel_err(st_k.recurrent, st_r.recurrent) < 2e-5
            assert torch.allclose(st_k.conv_ctx, st_r.conv_ctx)


def test_a_step_commits_only_its_own_row():
    gen = torch.Generator().manual_seed(3)
    gdn = random_layer(layer_config(2, 2, 16, 16), gen)
    gdn.kernel_isa = "scalar"
    st = gdn.new_state()
    with torch.inference_mode():
        gdn(torch.randn(1, 32, generator=gen), None, st)
    with pytest.raises(ValueError, match="commits the path"):
        gdn.commit(st, torch.tensor([1]))


def test_the_transposed_conv_weight_follows_the_weight():
    """The step's [K, C] copy of the conv weight is rebuilt when the weight changes in place; a layer built in
    inference mode (its weights inference tensors, with no version counter) works too."""
    gen = torch.Generator().manual_seed(4)
    gdn = random_layer(layer_config(2, 2, 16, 16), gen)
    first = gdn._conv_weight_t()
    assert torch.equal(first, gdn.conv_weight.detach().t()) and gdn._conv_weight_t() is first
    with torch.no_grad():
        gdn.conv_weight.mul_(2)
    assert torch.equal(gdn._conv_weight_t(), gdn.conv_weight.detach().t())
    with torch.inference_mode():
        layer = random_layer(layer_config(2, 2, 16, 16), gen)
        layer.kernel_isa = "scalar"
        st = layer.new_state()
        layer(torch.randn(1, 32, generator=gen), None, st)
    assert torch.equal(layer._conv_weight_t(), layer.conv_weight.t())


def test_without_kernel_isa_the_layer_keeps_the_composed_path():
    gdn = random_layer(layer_config(2, 2, 16, 16), torch.Generator().manual_seed(0))
    st = gdn.new_state()
    with torch.inference_mode():
        gdn(torch.randn(1, 32), None, st)
    assert st.pending.step is None and st.pending.core is not None


def test_bad_input_raises_clear_errors():
    gen = torch.Generator().manual_seed(0)
    gdn = random_layer(layer_config(2, 4, 8, 8), gen)
    st = gdn.new_state()
    wt = gdn.conv_weight.detach().t().contiguous()
    args = [gdn.A_log.detach(), gdn.dt_bias.detach(), gdn.norm.weight.detach()]
    proj = torch.randn(1, gdn.in_proj.weight.shape[0])
    with pytest.raises(ValueError, match="unknown isa"):
        gdn_step(proj, wt, st.conv_ctx, *args, st.recurrent, 2, 1e-6, "neon")
    with pytest.raises(ValueError, match="one token"):
        gdn_step(proj.repeat(2, 1), wt, st.conv_ctx, *args, st.recurrent, 2, 1e-6)
    with pytest.raises(RuntimeError, match="proj must hold"):
        gdn_step(proj[:, :-1], wt, st.conv_ctx, *args, st.recurrent, 2, 1e-6)
    with pytest.raises(RuntimeError, match="multiple of key heads"):
        gdn_step(proj, wt, st.conv_ctx, *args, st.recurrent, 3, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        gdn_step(proj.double(), wt, st.conv_ctx, *args, st.recurrent, 2, 1e-6)
