"""The lean runtime against transformers' own model on the same weights (fp32)."""
import torch

from drafttree.load import load_target
from runtime_helpers import check_against_reference, path_to, ref_logits












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
