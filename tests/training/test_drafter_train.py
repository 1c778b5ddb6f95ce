import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafttree.drafter import load_drafter
from drafttree.training.data import FeatureDataset, FeatureShardWriter
from drafttree.drafter.model import DFlashDrafter
from drafttree.training.train import BlockForward, TrainConfig, build_batch, main, train_drafter
from drafter_helpers import H, LAYER_IDS, V, synthetic, tiny_cfg

REPO = Path(__file__).resolve().parents[2]






def test_shards_and_batch(tmp_path):
    data, _, _ = synthetic(tmp_path)
    ds = FeatureDataset(data)
    assert len(ds) == 24 and len(ds.files) > 1 and ds.feature_dim == 3 * H and ds.target_layer_ids == LAYER_IDS
    s = ds[5]
    assert s["input_ids"].shape == (40,) and s["features"].dtype == torch.bfloat16 and s["loss_mask"][8:].all()
    b = build_batch([ds[0], ds[1]], tiny_cfg(), 6, torch.Generator().manual_seed(0), gamma=7.0)
    anchors = b["block_positions"].view(-1, 4)[:, 0]
    assert anchors.numel() == 12 and (anchors >= 7).all()
    # labels are the tokens at the same positions a+1..a+B-1, masked past the sequence end
    ids0 = ds[0]["input_ids"]
    for j in range(6):
        a = int(anchors[j])
        for i in range(1, 4):
            want = int(ids0[a + i]) if a + i < 40 else -1
            assert int(b["labels"][j, i - 1]) == want
    assert torch.allclose(b["weights"][0], torch.exp(-torch.arange(3) / 7.0)) or b["labels"][0].lt(0).any()


def test_batched_training_forward_equals_inference_path(tmp_path):
    data, _, embed = synthetic(tmp_path, n_seq=3)
    ds = FeatureDataset(data)
    seqs = [ds[0], ds[1], ds[2]]
    seqs[1] = {k: v[:20] for k, v in seqs[1].items()}  # shorter: padded context, fewer anchors
    cfg = tiny_cfg()
    torch.manual_seed(0)
    d = DFlashDrafter(cfg).double().eval()
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.1 * torch.randn_like(p))
    emb = embed.double()
    for max_context in (None, 9):
        b = build_batch(seqs, cfg, 14, torch.Generator().manual_seed(1), 7.0, max_context=max_context)
        S, Q = b["block_positions"].shape
        assert S == 3 and Q == 14 * 4
        with torch.no_grad():
            hidden = BlockForward(d, emb)(b["context_features"].double(), b["context_positions"], b["anchor_tokens"],
                                          b["block_positions"], b["attn_mask"]).view(S, 14, 4, H)
        checked = 0
        for i, s in enumerate(seqs):
            for j in range(14):
                a = int(b["block_positions"][i, 4 * j])
                if b["weights"].view(S, 14, 3)[i, j].sum() == 0:
                    continue  # padding block
                lo = 0 if max_context is None else max(0, a - max_context)
                ctx = d.new_context()
                d.extend_context(ctx, s["features"][lo:a].double(), torch.arange(lo, a))
                one = d.draft(ctx, d.block_embeds(s["input_ids"][a], emb), a)
                assert torch.allclose(hidden[i, j], one, atol=1e-10), (i, j)
                checked += 1
        assert checked >= 25


def test_training_decreases_loss_and_resumes_bit_identically(tmp_path):
    data, target, embed = synthetic(tmp_path)
    tc = TrainConfig(steps=40, seqs_per_step=2, blocks_per_seq=6, lr=3e-3, warmup_steps=5, log_every=5,
                     checkpoint_every=20)
    res = train_drafter(data, tmp_path / "run", embed, embed, tiny_cfg(), tc, progress=False)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m[-1]["loss"] < 0.6 * m[0]["loss"], (m[0]["loss"], m[-1]["loss"])
    assert m[-1]["tau"] > m[0]["tau"] and len(m[-1]["accuracy"]) == 3
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "accuracy.png").exists()
    final = load_drafter(tmp_path / "run" / "drafter")
    assert res["final"]["step"] == 40

    # same run through the CLI, interrupted at step 12 and resumed: bit-identical weights
    args = ["--data", str(data), "--target", str(target), "--out", str(tmp_path / "cli"), "--layers", "2",
            "--block-size", "4", "--steps", "40", "--seqs-per-step", "2", "--blocks-per-seq", "6", "--lr", "3e-3",
            "--warmup-steps", "5", "--log-every", "5", "--checkpoint-every", "20"]
    main(args + ["--stop-at", "12"])
    assert json.loads((tmp_path / "cli" / "checkpoint" / "trainer_state.json").read_text())["step"] == 12
    main(args)
    resumed = load_drafter(tmp_path / "cli" / "drafter")
    for (n, a), (_, b) in zip(final.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


def test_reduced_draft_vocab_trains(tmp_path):
    data, _, embed = synthetic(tmp_path)
    tc = TrainConfig(steps=3, seqs_per_step=2, blocks_per_seq=4, log_every=1)
    train_drafter(data, tmp_path / "run", embed, embed, tiny_cfg(draft_vocab_size=40), tc, progress=False)
    d = load_drafter(tmp_path / "run" / "drafter")
    counts = FeatureDataset(data).token_counts(V)
    assert set(d.draft_vocab.tolist()) == set(counts.argsort(descending=True, stable=True)[:40].tolist())


def test_loss_vocab_scores_the_top_ranked_draft_ids(tmp_path):
    """--loss-vocab N: the loss is the cross-entropy over the N highest-ranked draft ids (the head decoding narrows
    to), labels outside them carry none, predictions come back as token ids; the saved drafter keeps its whole
    draft vocabulary."""
    from drafttree.drafter.checkpoint import save_drafter
    from drafttree.drafter.reduce_vocab import RANK_FILE, save_rank
    from drafttree.training.train import block_loss, loss_head
    from drafttree.validate import InputError

    data, _, embed = synthetic(tmp_path)
    torch.manual_seed(0)
    d = DFlashDrafter(tiny_cfg(draft_vocab_size=40)).float()
    d.set_draft_vocab(torch.arange(3, 43))
    ranked = torch.arange(3, 43)[torch.randperm(40, generator=torch.Generator().manual_seed(1))]
    head = loss_head(embed, d, torch.float32, ranked, 16)
    assert torch.equal(head.ids, ranked[:16].sort().values) and torch.equal(head.weight, embed[head.ids])
    batch = build_batch([FeatureDataset(data)[i] for i in range(3)], d.config, 6, torch.Generator().manual_seed(0),
                        gamma=7.0)
    with torch.no_grad():
        hid = BlockForward(d, embed)(batch["context_features"].float(), batch["context_positions"],
                                     batch["anchor_tokens"], batch["block_positions"], batch["attn_mask"])
        loss, correct = block_loss(hid, batch, head, 64)
    B = d.config.block_size  # the reference: plain cross-entropy over the kept columns, kept labels only
    rows = hid.reshape(-1, B, H)[:, 1:].reshape(-1, H)
    logits, labels, w = rows @ embed[head.ids].t(), batch["labels"].reshape(-1), batch["weights"].reshape(-1)
    keep = torch.isin(labels, head.ids)
    col = torch.searchsorted(head.ids, labels.clamp(min=0)).clamp(max=15)
    ce = torch.logsumexp(logits, -1) - logits.gather(1, col[:, None])[:, 0]
    assert 0 < int(keep.sum()) < int((labels >= 0).sum())  # some labels in, some out
    torch.testing.assert_close(loss, (ce * w * keep).sum() / (w * keep).sum())
    assert torch.equal(correct.reshape(-1), head.ids[logits.argmax(-1)] == labels)
    # a run: the ranking comes from beside --init-from, and the trained drafter keeps all 40 draft ids
    init = save_drafter(d, tmp_path / "init")
    tc = TrainConfig(steps=2, seqs_per_step=2, blocks_per_seq=4, log_every=1, loss_vocab=16)
    with pytest.raises(InputError, match="--loss-vocab 16 needs draft_vocab_rank"):
        train_drafter(data, tmp_path / "run", embed, embed, None, tc, init_from=init, progress=False)
    save_rank(ranked, init / RANK_FILE)
    train_drafter(data, tmp_path / "run", embed, embed, None, tc, init_from=init, progress=False)
    out = load_drafter(tmp_path / "run" / "drafter")
    assert out.config.draft_vocab_size == 40 and torch.equal(out.draft_vocab, d.draft_vocab)


WORKER = textwrap.dedent("""
    import json, os, sys, torch
    from safetensors.torch import save_file
    sys.path.insert(0, {tests!r})
    from drafter_helpers import synthetic_paths, tiny_cfg
    from drafttree.training.train import TrainConfig, train_drafter
    torch.set_num_threads(1)
    data, embed = synthetic_paths({tmp!r})
    tc = TrainConfig(steps=4, seqs_per_step=2, blocks_per_seq=4, lr=3e-3, warmup_steps=1, log_every=2)
    res = train_drafter(data, {out!r}, embed, embed, tiny_cfg(), tc, progress=False)
    d = {{n: t.contiguous() for n, t in res.pop("drafter").state_dict().items()}}
    rank = res["rank"]
    save_file(d, os.path.join({tmp!r}, f"rank{{rank}}.safetensors"))
    json.dump(res["sequences_seen"], open(os.path.join({tmp!r}, f"seen{{rank}}.json"), "w"))
""")




def test_ddp_two_ranks_keep_identical_weights(tmp_path):
    synthetic(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).resolve().parents[1]), tmp=str(tmp_path), out=str(tmp_path / "out")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    w0, w1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    for n in w0:
        assert torch.equal(w0[n], w1[n]), n
    init = DFlashDrafter(tiny_cfg()).state_dict()
    assert not torch.equal(w0["fc.weight"], init["fc.weight"])  # it did train
    s0, s1 = json.loads((tmp_path / "seen0.json").read_text()), json.loads((tmp_path / "seen1.json").read_text())
    assert set(s0).isdisjoint(s1)  # the ranks saw different sequences


def test_heldout_tau_is_logged_and_rises(tmp_path):
    data, _, embed = synthetic(tmp_path)
    held, _, _ = synthetic(tmp_path / "held", n_seq=6)  # other counting sequences: learnable, never trained on
    tc = TrainConfig(steps=40, seqs_per_step=2, blocks_per_seq=6, lr=3e-3, warmup_steps=5, log_every=5,
                     checkpoint_every=20)
    res = train_drafter(data, tmp_path / "run", embed, embed, tiny_cfg(), tc, progress=False, heldout_dir=held)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    rows = [r for r in m if "heldout_tau" in r]
    assert [r["step"] for r in rows] == [0, 20, 40] and len(rows[0]["heldout_accuracy"]) == 3
    assert 1.0 <= rows[0]["heldout_tau"] <= 4.0 and rows[-1]["heldout_tau"] > rows[0]["heldout_tau"]
    assert res["final"]["step"] == 40 and "loss" in res["final"]
    # the same drafter scored again: the held-out anchors are fixed, so the figure repeats exactly
    from drafttree.training.train import _use_bf16, heldout_batches, heldout_metrics, loss_head

    d, bf16 = res["drafter"], _use_bf16(tc.bf16)
    head = loss_head(embed, d, torch.bfloat16 if bf16 else torch.float32)
    again = heldout_metrics(BlockForward(d, embed), heldout_batches(FeatureDataset(held), d.config, tc), d, head, tc, bf16)
    assert abs(again["heldout_tau"] - rows[-1]["heldout_tau"]) < 1e-6


def test_self_distillation_soft_targets_follow_the_label_rows(tmp_path):
    """A plain shard's per-row top-k ([T, k], row t: the target's top-k for token t) becomes each label's soft
    target; shards without them, and positions without a label, get none."""
    g = torch.Generator().manual_seed(1)
    T, k = 30, 3
    with FeatureShardWriter(tmp_path / "data", LAYER_IDS) as w:
        for _ in range(2):
            ids = torch.randint(0, V, (T,), generator=g)
            top_ids = torch.stack([ids, (ids + 1) % V, (ids + 2) % V], -1)  # top-1 = the token at the row
            lps = torch.log_softmax(torch.randn(T, k, generator=g), -1).sort(-1, descending=True).values
            lps[:6] = float("-inf")  # prompt rows: none
            w.add(ids, torch.randn(T, 3 * H, generator=g), torch.arange(T) >= 6, top_ids, lps)
    with FeatureShardWriter(tmp_path / "plain", LAYER_IDS) as w:
        w.add(torch.randint(0, V, (T,), generator=g), torch.randn(T, 3 * H, generator=g), torch.arange(T) >= 6)
    ds, plain = FeatureDataset(tmp_path / "data"), FeatureDataset(tmp_path / "plain")
    s = ds[1]
    assert s["topk_ids"].shape == (T, k) and s["topk_logprobs"].dtype == torch.float32
    b = build_batch([ds[0], ds[1], plain[0]], tiny_cfg(), 5, torch.Generator().manual_seed(0), gamma=7.0)
    assert b["topk_ids"].shape == (15, 3, k)
    anchors = b["block_positions"].view(-1, 4)[:, 0]
    for j in range(10):  # the two shards with top-k: 5 blocks each
        seq = ds[j // 5]
        for d in range(1, 4):
            row, label = int(anchors[j]) + d, int(b["labels"][j, d - 1])
            if label >= 0:
                assert b["topk_ids"][j, d - 1].tolist() == seq["topk_ids"][row].tolist() and label == int(seq["input_ids"][row])
                torch.testing.assert_close(b["topk_logprobs"][j, d - 1], seq["topk_logprobs"][row])
            else:
                assert torch.isinf(b["topk_logprobs"][j, d - 1]).all()
    assert torch.isinf(b["topk_logprobs"][10:]).all()  # the shard without top-k


def test_inconsistent_top_k_in_a_plain_shard_is_refused(tmp_path):
    import pytest

    from drafttree.training.data import write_feature_shard

    seq = (torch.arange(10), torch.zeros(10, 3 * H), torch.ones(10))
    write_feature_shard(tmp_path / "d" / "features-00000.safetensors", [seq], LAYER_IDS,
                        extra={"topk_ids": torch.zeros(9, 2, dtype=torch.int32),
                               "topk_logprobs": torch.zeros(9, 2, dtype=torch.float16)})
    with pytest.raises(ValueError, match="inconsistent top-k"):
        FeatureDataset(tmp_path / "d")
