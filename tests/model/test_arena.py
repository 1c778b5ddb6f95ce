"""The weights arena (model/arena.py): every parameter and buffer moves into one huge-page buffer with its values,
shapes and aliasing kept, and a quantized model decodes to the same bits with and without it."""
import sys

import pytest
import torch
import torch.nn as nn

from drafttree.load import load_target
from drafttree.model import arena
from drafttree.model.arena import HUGE_PAGE, pack_weights


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two modules
        self.norm = nn.LayerNorm(8)
        whole = torch.arange(24.0).view(4, 6)
        self.register_buffer("table", whole[:, 1:4])  # strided views of one bigger storage
        self.register_buffer("column", whole[:, 2])
        self.register_buffer("scales", self.table.new_zeros(3).half())
        self.register_buffer("absent", None)


@pytest.mark.skipif(sys.platform != "linux", reason="the arena is Linux's (madvise)")
def test_every_tensor_moves_with_its_values_and_aliases(monkeypatch):
    monkeypatch.setenv("DRAFTTREE_HUGE_PAGES", "1")
    model = Tied()
    before = {k: (v.clone(), v.stride()) for k, v in model.state_dict().items()}
    param = model.embed.weight
    buffer = pack_weights(model)
    assert buffer is not None and buffer.data_ptr() % HUGE_PAGE == 0
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert lo <= t.data_ptr() < hi, name
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, (v, stride) in before.items():
        assert torch.equal(v, after[k]) and after[k].stride() == stride, k
    assert model.embed.weight is param and model.head.weight is param  # the same objects, moved in place
    model.table[1, 1] = -1.0  # views of one storage still share it
    assert model.column[1] == -1.0
    model.embed.weight.data[0, 0] = 7.0
    assert model.head.weight[0, 0] == 7.0


def test_disabled_moves_nothing(monkeypatch):
    monkeypatch.setenv("DRAFTTREE_HUGE_PAGES", "0")
    model = Tied()
    ptr = model.embed.weight.data_ptr()
    assert pack_weights(model) is None and model.embed.weight.data_ptr() == ptr


@pytest.mark.skipif(sys.platform != "linux", reason="the arena is Linux's (madvise)")
@pytest.mark.parametrize("compute", ["int8", "q4"])
def test_quantized_target_same_bits_with_and_without_the_arena(tiny_checkpoint, monkeypatch, compute):
    models = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("DRAFTTREE_HUGE_PAGES", flag)
        models[flag] = load_target(str(tiny_checkpoint[0]), compute=compute).model
    packed = models["1"]
    assert packed.decoder_stack is not None
    stack_ptrs = {t.data_ptr() for layer in packed.decoder_stack.layers for t in layer if t.numel()}
    head = packed.lm_head.weight_packed
    base = head.untyped_storage().data_ptr()  # the arena's storage: every weight is a view of it
    assert all(t.untyped_storage().data_ptr() == base for layer in packed.decoder_stack.layers for t in layer
               if t.numel()) and stack_ptrs
    ids = torch.arange(3, 30) % packed.config.vocab_size
    logits = [m.forward(m.new_state(40), ids).logits for m in models.values()]
    assert torch.equal(*logits)


def test_huge_page_buffer_is_aligned_and_writable():
    buf = arena._huge_page_buffer(3 * HUGE_PAGE // 2 + 5)
    assert buf.numel() == 3 * HUGE_PAGE // 2 + 5 and buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(3)
    assert int(buf.sum()) == 3 * buf.numel()


@pytest.mark.parametrize("mode,expect", [("always [madvise] never", "yes (transparent huge pages: madvise)"),
                                         ("always madvise [never]", "turns them on"),
                                         ("[always] madvise never", "yes (transparent huge pages: always)")])
def test_status_line_reads_the_system_setting(tmp_path, monkeypatch, mode, expect):
    monkeypatch.setenv("DRAFTTREE_HUGE_PAGES", "1")
    monkeypatch.setattr(sys, "platform", "linux")
    setting = tmp_path / "enabled"
    setting.write_text(mode + "\n")
    assert expect in arena.huge_pages_status(str(setting))
    monkeypatch.setenv("DRAFTTREE_HUGE_PAGES", "0")
    assert "off" in arena.huge_pages_status(str(setting))
