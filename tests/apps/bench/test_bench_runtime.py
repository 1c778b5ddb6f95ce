"""bench-runtime on a tiny random checkpoint: the forward-cost curve, the AR comparison and the outputs."""
import json
import pytest
import torch

from drafttree.apps.bench import runtime
from drafttree.load import load_target
from tiny_models import make_tiny_checkpoint


def test_forward_cost_curve_and_outputs(tmp_path):
    ckpt = tmp_path / "tiny"
    make_tiny_checkpoint("llama", ckpt)
    target = load_target(str(ckpt), dtype="float32", threads=1)
    sizes, contexts = (1, 2, 4, 8), (0, 32, 64)
    rows = runtime.forward_cost_curve(target, contexts=contexts, sizes=sizes, repeats=2, progress=False)
    assert [(r["context"], r["tokens"]) for r in rows] == [(c, n) for c in contexts for n in sizes]
    for r in rows:
        assert r["ms"] > 0 and len(r["ms_all"]) == 2
        assert r["ms"] == pytest.approx(sum(r["ms_all"]) / 2)  # median of two
    assert all(r["ratio_to_1"] == 1.0 for r in rows if r["tokens"] == 1)

    # the measured forward is the real one: a state's uncommitted rows do not affect a later decode
    m = target.model
    ids = torch.arange(10) % m.config.vocab_size
    ref = m.forward(m.new_state(64), ids).logits[-1].clone()
    st = m.new_state(64)
    m.prefill(st, ids[:-1])
    m.forward(st, ids[:3])  # scratch rows, never committed
    assert torch.allclose(m.forward(st, ids[-1:]).logits[-1], ref, atol=1e-4)

    results = dict(model="tiny", threads=1, torch=torch.__version__, transformers="x", cpu="cpu", hf_attn="eager",
                   repeats=2, timestamp="now", curves={"fp32": rows})
    paths = runtime.write_outputs(results, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["curves"]["fp32"][0]["tokens"] == 1
    md = paths["md"].read_text()
    assert "fp32 ctx 64 ms" in md and md.count("\n| 8 |") == 1
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ar_comparison_tiny(tmp_path):
    ckpt = tmp_path / "tiny"
    make_tiny_checkpoint("llama", ckpt)
    target = load_target(str(ckpt), dtype="float32", threads=1)
    runners = {"drafttree-fp32": ("drafttree", target),
               "transformers-fp32": ("transformers", runtime.load_hf(ckpt, "float32"))}
    prompts = [torch.tensor([3, 17, 42, 5]), torch.tensor([9, 8, 7])]
    ar = runtime.bench_ar(runners, prompts, max_new=12, warmup_tokens=2, progress=False)
    assert set(ar["configs"]) == set(runners)
    assert all(c["tokens"] == 24 and c["tokens_per_s"] > 0 for c in ar["configs"].values())
    # same weights, greedy, fp32: the two libraries produce the same tokens
    assert [r["agree_prefix"]["fp32"] for r in ar["per_prompt"]] == [12, 12]
    assert ar["ratios"]["faster dtype"] == {"drafttree": "fp32", "transformers": "fp32"}
    assert ar["ratios"]["drafttree/transformers fp32"] > 0

    floor = runtime.weight_floor(target.model, repeats=2)
    weights = {p.data_ptr(): p for p in target.model.parameters() if p.dim() == 2}.values()
    assert floor["weight_mb"] == pytest.approx(sum(p.numel() * 4 for p in weights) / 1e6) and floor["ms"] > 0
    results = dict(model="tiny", threads=1, torch="t", transformers="x", cpu="cpu", hf_attn="eager", repeats=2,
                   timestamp="now", ar=ar, weight_floor={"fp32": floor})
    md = runtime.markdown(results)
    assert "| drafttree-fp32 |" in md and "each at its faster dtype" in md
    assert "## The floor" in md and "| fp32 |" in md


def test_cli_parses_bench_runtime_options():
    from drafttree.apps.cli import build_parser

    a = build_parser().parse_args(["bench-runtime", "--quick", "--contexts", "64", "--skip-ar"])
    assert a.quick and a.skip_ar and a.contexts == "64" and a.prompts == 5 and a.threads == 2
    assert runtime._ints(a.contexts) == (64,)
