"""A reduced draft vocabulary after training: the same hidden states, the head restricted to the
chosen ids (others -inf), and a save/load round trip."""
import torch

from drafttree.drafter.checkpoint import load_drafter, save_drafter
from drafttree.drafter.model import DFlashConfig, DFlashDrafter
from drafttree.drafter.reduce_vocab import with_draft_vocab


def test_reduced_head_scores_only_the_top_ids(tmp_path):
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, target_layer_ids=[0, 1])
    full = DFlashDrafter(cfg).eval()
    counts = torch.arange(50).flip(0) * 3  # id 0 most frequent
    reduced, coverage = with_draft_vocab(full, counts, 10)
    assert 0.3 < coverage < 1.0
    head = torch.randn(50, 32)
    hidden = torch.randn(4, 32)
    a, b = full.draft_logits(hidden, head), reduced.draft_logits(hidden, head)
    torch.testing.assert_close(b[:, :10], a[:, :10])
    assert torch.isinf(b[:, 10:]).all()
    save_drafter(reduced, tmp_path / "r")
    back = load_drafter(tmp_path / "r")
    assert torch.equal(back.draft_vocab, torch.arange(10))
    assert torch.equal(back.draft_logits(hidden, head), b)
