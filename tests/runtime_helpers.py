"""Helpers for tests that check the runtime against a reference: random trees, their masks and paths, and
logits against transformers' own model."""
import torch

from drafttree.compute import cpu_info


def kernel_isas(avx512_flag: str = "avx512_vnni") -> list[str]:
    """The C++ kernels' code paths this CPU runs (honouring DRAFTTREE_ISA=avx2): scalar always, AVX2, and the
    AVX-512 one where the CPU has `avx512_flag` (VNNI for the integer matmuls, plain AVX-512F for float kernels)."""
    return ["scalar"] + [isa for isa, flag in (("avx2", "avx2"), ("avx512_vnni", avx512_flag)) if cpu_info().has(flag)]


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


def tree_and_step_logits(m, prompt: torch.Tensor, parents: list[int], tokens: torch.Tensor):
    """One tree verify after `prompt` ([n, V] logits, a row per node), and per node the logits of one-token steps
    along its path from a fresh prefill (the reference a tree row is held to)."""
    mask = ancestor_mask(parents)
    st = m.new_state(128)
    m.prefill(st, prompt)
    tree = m.forward(st, tokens, positions=prompt.numel() + mask.sum(1) - 1, tree_mask=mask).logits
    steps = []
    for i in range(len(parents)):
        st = m.new_state(128)
        m.prefill(st, prompt)
        for tok in tokens[path_to(parents, i)]:
            step = m.forward(st, tok.view(1)).logits[0]
            m.commit(st, torch.tensor([0]))
        steps.append(step)
    return tree, steps
