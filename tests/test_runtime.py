"""The lean runtime against transformers' own model on the same weights (fp32)."""
import pytest
import torch

from drafttree.load import load_target


def random_tree_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        m[i] |= m[parents[i]]
    return m


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


def check_against_reference(target, ref, prompt: torch.Tensor, atol: float, n_tree: int = 12):
    m = target.model
    st = m.new_state(256)
    full = ref_logits(ref, prompt)
    # prefill + one-token decode
    out = m.forward(st, prompt[:-1])
    assert torch.allclose(out.logits, full[:-1], atol=atol), (out.logits - full[:-1]).abs().max()
    m.commit(st, torch.arange(prompt.numel() - 1))
    one = m.forward(st, prompt[-1:])
    assert torch.allclose(one.logits[0], full[-1], atol=atol)
    # (a) chain: several new tokens after a cached prefix, causal among themselves
    st = m.new_state(256)
    m.prefill(st, prompt[:4])
    chain = m.forward(st, prompt[4:])
    assert torch.allclose(chain.logits, full[4:], atol=atol)
    # (b) random tree after the prefix: every node equals a sequential run along its root-to-node path
    st = m.new_state(256)
    m.prefill(st, prompt)
    gen = torch.Generator().manual_seed(1)
    parents = random_tree_parents(n_tree, gen)
    tokens = torch.randint(0, m.config.vocab_size, (n_tree,), generator=gen)
    mask = ancestor_mask(parents)
    depths = mask.sum(1) - 1
    tree = m.forward(st, tokens, positions=prompt.numel() + depths, tree_mask=mask)
    for i in range(n_tree):
        seq = torch.cat([prompt, tokens[path_to(parents, i)]])
        assert torch.allclose(tree.logits[i], ref_logits(ref, seq)[-1], atol=atol), f"node {i}"
    return parents, tokens, tree, st


def test_tiny_matches_transformers(tiny_checkpoint):
    path, ref = tiny_checkpoint
    target = load_target(str(path))
    prompt = torch.randint(0, 211, (10,), generator=torch.Generator().manual_seed(0))
    check_against_reference(target, ref, prompt, atol=1e-4)


def test_kv_commit_of_tree_path_equals_recompute(tiny_checkpoint):
    path, ref = tiny_checkpoint
    target = load_target(str(path))
    m = target.model
    prompt = torch.randint(0, 211, (7,), generator=torch.Generator().manual_seed(3))
    parents, tokens, _, st = check_against_reference(target, ref, prompt, atol=1e-4, n_tree=10)
    accepted = path_to(parents, 9)  # root ... node 9
    m.commit(st, torch.tensor(accepted))
    assert st.length == prompt.numel() + len(accepted)
    nxt = torch.tensor([5])
    after = m.forward(st, nxt).logits[0]
    seq = torch.cat([prompt, tokens[accepted], nxt])
    assert torch.allclose(after, ref_logits(ref, seq)[-1], atol=1e-4)
    # the compacted cache equals a cache built from scratch over the same tokens
    fresh = m.new_state(256)
    m.prefill(fresh, seq[:-1])
    n = fresh.length
    assert torch.allclose(st.kv.k[:, :, :n], fresh.kv.k[:, :, :n], atol=1e-5)
    assert torch.allclose(st.kv.v[:, :, :n], fresh.kv.v[:, :, :n], atol=1e-5)


def test_capture_layers_are_outputs_of_decoder_layers(tiny_checkpoint):
    path, ref = tiny_checkpoint
    m = load_target(str(path)).model
    prompt = torch.arange(1, 9)
    out = m.forward(m.new_state(64), prompt, capture_layers=(1, 0))
    with torch.no_grad():
        hs = ref(prompt[None], output_hidden_states=True).hidden_states
    h = m.config.hidden_size
    # hidden_states[i + 1] is the output of decoder layer i (index 0 is the embedding output);
    # features come in the caller's order, not depth order
    assert torch.allclose(out.features[:, :h], hs[2][0], atol=1e-4)
    assert torch.allclose(out.features[:, h:], hs[1][0], atol=1e-4)


def test_logits_rows_selects_rows(tiny_checkpoint):
    path, _ = tiny_checkpoint
    m = load_target(str(path)).model
    prompt = torch.arange(1, 9)
    full = m.forward(m.new_state(64), prompt).logits
    part = m.forward(m.new_state(64), prompt, logits_rows=torch.tensor([2, 7])).logits
    assert torch.allclose(part, full[[2, 7]], atol=1e-5)
