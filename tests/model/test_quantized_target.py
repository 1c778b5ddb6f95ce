"""The quantized compute paths (int8, q4) end to end on tiny models: the module swap, bit-exact tree
verification, and speculative decoding identical to AR decoding on the same path."""
import itertools

import pytest
import torch

from drafttree.engine import generate_ar, generate_speculative
from drafttree.load import load_target
from drafttree.model.linear import Int8Linear, Q4Linear, quantize_linears, use_cpu_kernels
from drafttree.ops.decoder import DecoderStack
from drafttree.proposers import BestFirstPolicy, ChainPolicy, DFlashProposer
from spec_helpers import TargetCopyProposer, random_drafter_for
from runtime_helpers import random_tree_parents, tree_and_step_logits


def int8_target(path, isa=None, compute="int8"):
    target = load_target(str(path), compute=compute)
    if isa is not None:
        for m in target.model.modules():
            if isinstance(m, Int8Linear):
                m.isa = isa
        target.model.decoder_stack = DecoderStack.of(target.model)  # None for the reference: the layer loop
    return target


def test_every_linear_and_the_head_are_int8(tiny_checkpoint):
    model = int8_target(tiny_checkpoint[0]).model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear) and model.dtype == torch.float32
    fp32 = load_target(str(tiny_checkpoint[0])).model
    n_weights = sum(m.weight.numel() for m in fp32.modules() if isinstance(m, torch.nn.Linear))
    n_weights += 0 if fp32.lm_head is not None else fp32.embed_tokens.weight.numel()
    int8_bytes = sum({id(m.weight_packed): m.weight_packed.numel() for m in model.modules()
                      if isinstance(m, Int8Linear)}.values())  # a tied embedding shares the head's bytes
    assert n_weights <= int8_bytes < 1.3 * n_weights  # one byte a weight (plus panel padding)


def test_kernel_model_equals_reference_model(tiny_checkpoint):
    """The C++ int8 kernel and its plain-PyTorch reference give the same logits, bit for bit, in a model."""
    fast, ref = int8_target(tiny_checkpoint[0]), int8_target(tiny_checkpoint[0], isa="reference")
    ids = torch.arange(3, 40) % fast.model.config.vocab_size
    logits = [m.forward(m.new_state(64), ids).logits for m in (fast.model, ref.model)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_tree_logits_equal_sequential_steps_bit_for_bit(tiny_checkpoint, compute):
    """On the quantized paths every node's logits are exactly those of one-token steps along its path."""
    m = int8_target(tiny_checkpoint[0], compute=compute).model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.config.vocab_size, (9,), generator=gen)
    parents = random_tree_parents(12, gen)
    tokens = torch.randint(0, m.config.vocab_size, (12,), generator=gen)
    tree, steps = tree_and_step_logits(m, prompt, parents, tokens)
    for i, step in enumerate(steps):
        assert torch.equal(step, tree[i]), f"node {i}"


@pytest.mark.parametrize("make_policy", [ChainPolicy, lambda: BestFirstPolicy(4), lambda: BestFirstPolicy(32)],
                         ids=["chain", "ddtree4", "ddtree32"])
@pytest.mark.parametrize("noise", [0.0, 3.0])
@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_greedy_speculation_equals_ar_on_the_quantized_paths(tiny_checkpoint, make_policy, noise, compute):
    path, _ = tiny_checkpoint
    target = int8_target(path, compute=compute)
    proposer = TargetCopyProposer(path, make_policy(), noise=noise)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, target.model.config.vocab_size, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen)
        ar = generate_ar(target, ids, max_new_tokens=40, stop_token_ids=()).tokens
        assert generate_speculative(target, ids, proposer, max_new_tokens=40, stop_token_ids=()).tokens == ar


def test_int8_dflash_drafter_runs_on_the_int8_path(tiny_checkpoint):
    from drafttree.model.linear import quantize_linears

    path, _ = tiny_checkpoint
    target = int8_target(path)
    drafter = quantize_linears(random_drafter_for(target.model), "scalar")
    proposer = DFlashProposer(drafter, target.model, BestFirstPolicy(8))
    ids = torch.arange(2, 10)
    ar = generate_ar(target, ids, max_new_tokens=24, stop_token_ids=()).tokens
    assert generate_speculative(target, ids, proposer, max_new_tokens=24, stop_token_ids=()).tokens == ar


def test_q4_path_holds_4_bit_weights(tiny_checkpoint):
    model = int8_target(tiny_checkpoint[0], compute="q4").model
    q4 = [m for m in model.modules() if isinstance(m, Q4Linear)]
    assert q4 and isinstance(model.lm_head, Int8Linear)
    for m in q4:  # half a byte a weight, plus fp16 scale and minimum per 32 weights
        assert m.weight_q4.numel() * 2 >= m.out_features * m.in_features
        assert m.weight_q4.numel() <= 0.6 * (-(-m.out_features // 16) * 16) * m.in_features


@pytest.mark.parametrize("kernels", [False, True], ids=["pytorch", "cpu-kernels"])
def test_fused_drafter_drafts_the_same(tiny_checkpoint, kernels):
    """fuse_projections (q/k/v and gate/up as one matmul each), and with `kernels` the one-call-per-layer
    C++ path (norms, RoPE, attention), draft the same hidden states as the plain PyTorch drafter (fp32)."""
    import copy

    from drafttree.model.linear import use_cpu_kernels

    target = load_target(str(tiny_checkpoint[0]))
    plain = random_drafter_for(target.model)
    fused = copy.deepcopy(plain).fuse_projections()
    if kernels:
        use_cpu_kernels(fused, "scalar")
    feats = torch.randn(9, plain.config.context_dim)
    outs = []
    for d in (plain, fused):
        ctx = d.new_context()
        d.extend_context(ctx, feats, torch.arange(9))
        outs.append(d.draft(ctx, d.block_embeds(3, target.model.embed), 9))
    assert torch.allclose(outs[0], outs[1], atol=1e-4)


@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_rows_the_walk_reaches_later_equal_the_full_forward(tiny_checkpoint, compute):
    """The engine's verify computes the head for a larger tree's principal path only; every other node's logits,
    computed when a walk reaches it (verify.TreeLogits), are the bits a forward with every row's logits gives. A small
    tree gets every node's logits in the forward, with the same bits, and a walk never calls the head again."""
    from drafttree.engine import ALL_LOGITS_MAX_NODES, verify_input
    from drafttree.model.verify_input import VerifyInput
    from drafttree.tree import random_tree
    from drafttree.verify import TreeLogits

    m = int8_target(tiny_checkpoint[0], compute=compute).model
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, m.config.vocab_size, (7,), generator=gen)
    for shape, drafts in itertools.product(("random", "star", "deep", "chain"), (11, ALL_LOGITS_MAX_NODES - 1)):
        tree = random_tree(drafts, m.config.vocab_size, shape, gen)
        full_state, lazy_state = m.new_state(64), m.new_state(64)
        m.prefill(full_state, prompt)
        m.prefill(lazy_state, prompt)
        full = m.verify(full_state, VerifyInput.of_tree(tree, prompt.numel())).logits
        batch = verify_input(tree, prompt.numel())
        small = tree.num_nodes <= ALL_LOGITS_MAX_NODES
        assert batch.logits_rows.tolist() == (list(range(tree.num_nodes)) if small else tree.principal_path())
        res = m.verify(lazy_state, batch)
        lazy = TreeLogits(tree, res.logits, batch.logits_rows.tolist(), res.hidden, m.row_logits)
        for node in reversed(range(tree.num_nodes)):  # off-path nodes first: each costs one more head call
            assert torch.equal(lazy(node), full[node]), (shape, node)
        assert lazy.head_calls == 1 if small else lazy.head_calls <= 1 + tree.num_nodes - len(tree.principal_path())


def test_every_module_with_a_fused_form_is_switched_by_type(tiny_checkpoint):
    """use_cpu_kernels routes modules by their class (FusedKernel / KernelAttention / StackedLayers), never by
    attribute probing: every module holding a `kernel_isa` is a FusedKernel, and on a kernel path every one is set."""
    from drafttree.model.layers import FusedKernel, KernelAttention, StackedLayers

    target = load_target(str(tiny_checkpoint[0]), compute="q4")
    drafter = random_drafter_for(target.model)
    use_cpu_kernels(quantize_linears(drafter.fuse_projections(), "scalar"), "scalar")
    for model in (target.model, drafter):
        assert isinstance(model, KernelAttention) and isinstance(model, StackedLayers)
        assert model.attention_kernel is not None and model.decoder_stack is not None
        holders = [m for m in model.modules() if "kernel_isa" in vars(m)]
        assert holders and all(isinstance(m, FusedKernel) and m.kernel_isa is not None for m in holders)
