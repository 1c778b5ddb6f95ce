"""The decoder stack in one C++ call against the Python layer loop it replaces (its reference): the same
logits, captured hidden states and KV-cache rows, bit for bit, on tiny models of each family and on the
real model, for a prefill, a one-token step and a tree."""
import pytest
import torch

from drafttree.load import load_target
from drafttree.model.linear import Int8Linear, Q4Linear, Q8Linear
from drafttree.ops.decoder import DecoderStack
from runtime_helpers import ancestor_mask, kernel_isas, random_tree_parents

ISAS = kernel_isas()


def run(model, prompt, tokens, mask, capture):
    """Prefill, one step, then a tree: (logits, features) of each and the cache rows written."""
    st = model.new_state(128)
    outs = [model.forward(st, prompt, capture_layers=capture)]
    model.commit(st, torch.arange(prompt.numel()))
    outs.append(model.forward(st, tokens[:1], capture_layers=capture))
    model.commit(st, torch.tensor([0]))
    past = st.kv.length
    outs.append(model.forward(st, tokens, positions=past + mask.sum(1) - 1, tree_mask=mask, capture_layers=capture))
    n = past + tokens.numel()
    return [(o.logits, o.features) for o in outs], st.kv.k[:, :, :n].clone(), st.kv.v[:, :, :n].clone()


def load(checkpoint, compute):
    """The tiny model on a kernel path; "q8": the q4 path with its Q4_1 layers as 8-bit blocks (the stack's third
    kind, a GGUF file's Q8_0 / Q5_0 tensors), the values carried over exactly."""
    model = load_target(str(checkpoint), compute="q4" if compute == "q8" else compute).model
    if compute == "q8":
        for name, m in list(model.named_modules()):
            if isinstance(m, Q4Linear):
                owner, attr = name.rsplit(".", 1)
                setattr(model.get_submodule(owner), attr, Q8Linear(*m.unpack(*m.packed, m.out_features), m.bias, m.isa))
    return model


def on_isa(model, isa):
    """Every kernel of `model` on one ISA path."""
    for m in model.modules():
        if hasattr(m, "isa"):
            m.isa = isa
        if hasattr(m, "kernel_isa") and m.kernel_isa is not None:
            m.kernel_isa = isa
    model.attention_kernel = isa


def same(a, b):
    (outs_a, ka, va), (outs_b, kb, vb) = a, b
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    for (la, fa), (lb, fb) in zip(outs_a, outs_b):
        assert torch.equal(la, lb)
        assert (fa is None and fb is None) or torch.equal(fa, fb)


@pytest.mark.parametrize("compute", ["int8", "q4", "q8"])
@pytest.mark.parametrize("isa", ISAS)
def test_stack_equals_the_layer_loop(tiny_checkpoint, compute, isa):
    model = load(tiny_checkpoint[0], compute)
    on_isa(model, isa)
    stack = DecoderStack.of(model)
    assert stack is not None
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (11,), generator=gen)
    parents = random_tree_parents(9, gen)
    tokens = torch.randint(0, model.config.vocab_size, (9,), generator=gen)
    capture = (0, model.config.num_layers - 1)
    model.decoder_stack = stack
    fused = run(model, prompt, tokens, ancestor_mask(parents), capture)
    model.decoder_stack = None
    same(fused, run(model, prompt, tokens, ancestor_mask(parents), capture))


def test_no_stack_where_it_does_not_fit(tiny_checkpoint):
    """Float paths and the plain-PyTorch reference linears keep the layer loop."""
    assert load_target(str(tiny_checkpoint[0]), compute="fp32").model.decoder_stack is None
    model = load_target(str(tiny_checkpoint[0]), compute="int8").model
    assert model.decoder_stack is not None
    next(m for m in model.modules() if isinstance(m, Int8Linear) and m is not model.lm_head).isa = "reference"
    assert DecoderStack.of(model) is None


def test_stack_equals_the_layer_loop_on_smollm2():
    target = load_target("smollm2-135m-instruct", compute="auto")
    model = target.model
    if model.decoder_stack is None:
        pytest.skip(f"no kernel path here ({target.compute_label})")
    prompt = target.encode_chat("What is 17 * 23?")
    parents = [-1, 0, 0, 1, 2, 3, 3, 4]
    tokens = torch.tensor([504, 28, 33, 1789, 284, 216, 30, 40])
    capture = (1, 7, 14, 20, 27)
    fused = run(model, prompt, tokens, ancestor_mask(parents), capture)
    stack, model.decoder_stack = model.decoder_stack, None
    try:
        same(fused, run(model, prompt, tokens, ancestor_mask(parents), capture))
    finally:
        model.decoder_stack = stack


def run_many(model, prompts, trees, capture):
    """Prefill each request, then verify all their trees in one batched forward: (logits, features) per request
    and the cache rows each request's state holds."""
    from drafttree.model.verify_input import VerifyInput

    states, batches = [], []
    for prompt, (parents, tokens) in zip(prompts, trees):
        st = model.new_state(64)
        model.forward(st, prompt)
        model.commit(st, torch.arange(prompt.numel()))
        states.append(st)
        mask = ancestor_mask(parents)
        batches.append(VerifyInput(tokens, st.kv.length + mask.sum(1) - 1, torch.tensor(parents), mask))
    outs = model.verify_many(states, batches, [capture] * len(states))
    rows = [st.kv.length + b.num_nodes for st, b in zip(states, batches)]
    return ([(o.logits, o.features) for o in outs],
            torch.cat([st.kv.k[:, :, :n].flatten() for st, n in zip(states, rows)]),
            torch.cat([st.kv.v[:, :, :n].flatten() for st, n in zip(states, rows)]))


@pytest.mark.parametrize("compute", ["int8", "q4", "q8"])
@pytest.mark.parametrize("isa", ISAS)
def test_batched_stack_equals_the_segment_loop(tiny_checkpoint, compute, isa):
    """verify_many through decoder_stack_batched (one call for several requests' trees) against the Python loop of
    forward_segments: the same logits, features and cache rows, bit for bit; requests of different lengths, trees and
    a one-token row among them."""
    model = load(tiny_checkpoint[0], compute)
    on_isa(model, isa)
    stack = DecoderStack.of(model)
    gen = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 13, 8)]
    trees = []
    for size in (7, 1, 4):
        parents = random_tree_parents(size, gen) if size > 1 else [-1]
        trees.append((parents, torch.randint(0, vocab, (size,), generator=gen)))
    capture = (0, model.config.num_layers - 1)
    model.decoder_stack = stack
    fused = run_many(model, prompts, trees, capture)
    model.decoder_stack = None
    same(fused, run_many(model, prompts, trees, capture))
