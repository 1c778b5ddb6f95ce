"""`drafttree bench`: every method side by side on a tiny random llama with a random DFlash drafter."""
import argparse
import json

import pytest
import torch

from drafttree.apps.bench.methods import add_arguments, benchmark, markdown_report, mismatch_lines, parse_variants
from drafttree.load import load_target
from drafttree.proposers import BestFirstPolicy, ChainPolicy, CostAwarePolicy
from drafttree.sampling import SamplingParams
from spec_helpers import TargetCopyProposer, random_drafter_for, synthetic_cost_model
from tiny_models import make_tiny_checkpoint



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-llama")
    make_tiny_checkpoint("llama", path)
    target = load_target(str(path))
    torch.set_num_threads(1)  # tiny matmuls: threads only add sync stalls (load_target sets all cores)
    return target, random_drafter_for(target.model), path


def token_prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_parse_variants():
    names = [v.name for v in parse_variants("ddtree,caddtree,chain", "4,16")]
    assert names == ["ar", "ddtree-4", "ddtree-16", "caddtree", "chain"]
    with pytest.raises(ValueError):
        parse_variants("ar,beam", "4")
    with pytest.raises(ValueError):
        parse_variants("ddtree", "0")


def test_arguments():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--budgets", "4,8", "--datasets", "gsm8k", "--limit", "2", "--drafter", "d", "--out", "o"])
    assert (a.budgets, a.datasets, a.limit, a.drafter, a.out, a.temperature) == ("4,8", "gsm8k", 2, "d", "o", 0.0)
    assert p.parse_args(["--budget", "32"]).budgets == "32"


def test_bench_greedy_writes_reports_and_is_lossless(tiny, tmp_path):
    target, drafter, _ = tiny
    vocab = target.model.config.vocab_size
    prompts = {"setA": token_prompts(2, vocab, 0), "setB": token_prompts(2, vocab, 1)}
    res = benchmark(target, prompts, ["ar", "chain", "ddtree", "caddtree"], drafter=drafter, budgets=(4, 16),
                    max_new_tokens=24, cost_model=synthetic_cost_model(), max_tree_nodes=32, stop_token_ids=(),
                    out_dir=tmp_path, progress=False, config=dict(model="tiny-llama"))
    names = ["ar", "chain", "ddtree-4", "ddtree-16", "caddtree"]
    for f in ["results.json", "results.md", "records.jsonl", "tau_vs_budget.png", "tokens_per_s_vs_budget.png",
              "speedup_vs_budget.png", "accept_lengths.png", "caddtree_tree_sizes.png"]:
        assert (tmp_path / f).stat().st_size > 0, f
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["records"]) == 4 * len(names)
    assert set(saved["aggregates"]) == {"setA", "setB"}
    for ds, rows in saved["aggregates"].items():
        assert list(rows) == names
        assert rows["ar"]["speedup"] == pytest.approx(1.0) and rows["ar"]["tau"] == 1.0
        for name in names[1:]:
            r = rows[name]
            assert r["mismatches"] == 0 and r["checked"] == 2
            assert r["new_tokens"] == 2 * 24 and r["tau"] >= 1.0 and r["speedup"] > 0
            assert r["draft_s"] + r["tree_s"] + r["verify_s"] + r["other_s"] == pytest.approx(r["decode_s"], rel=1e-3, abs=1e-3)
            assert r["mean_tree_size"] > 0
        assert rows["ddtree-4"]["mean_tree_size"] <= 4
        assert rows["caddtree"]["mean_tree_size"] <= 32
    mean = saved["mean_over_datasets"]
    assert all(mean[n]["mismatches"] == 0 and mean[n]["checked"] == 4 for n in names[1:])
    md = (tmp_path / "results.md").read_text()
    assert "## setA" in md and "## setB" in md and "## mean over datasets" in md and "| ddtree-16 |" in md
    assert all("0/4" in line for line in mismatch_lines(res))
    assert md == markdown_report(res)


def test_bench_sampling_skips_lossless_check(tiny):
    target, drafter, _ = tiny
    prompts = {"setA": token_prompts(1, target.model.config.vocab_size, 2)}
    res = benchmark(target, prompts, ["chain", "ddtree"], drafter=drafter, budgets=(8,), max_new_tokens=12,
                    sampling=SamplingParams(temperature=1.0, seed=3), stop_token_ids=(), progress=False, warmup_tokens=0)
    rows = res["aggregates"]["setA"]
    assert list(rows) == ["ar", "chain", "ddtree-8"]
    assert all(r["checked"] == 0 and r["mismatches"] == 0 for r in rows.values())
    assert all(r["matches_ar"] is None for r in res["records"])
    assert "skipped" in mismatch_lines(res)[0]


def test_bench_deep_acceptance_is_lossless(tiny):
    """Drafts from a noisy copy of the target: long accepted paths and rejections, still AR's tokens exactly."""
    target, _, path = tiny
    prompts = {"setA": token_prompts(2, target.model.config.vocab_size, 4)}
    proposers = {"chain": TargetCopyProposer(path, ChainPolicy(), noise=1.0),
                 "ddtree-8": TargetCopyProposer(path, BestFirstPolicy(8), noise=1.0),
                 "caddtree": TargetCopyProposer(path, CostAwarePolicy(synthetic_cost_model(), 32), noise=1.0)}
    torch.set_num_threads(1)  # the copies' load_target set all cores
    res = benchmark(target, prompts, ["chain", "ddtree", "caddtree"], budgets=(8,), max_new_tokens=30,
                    stop_token_ids=(), progress=False, warmup_tokens=0, proposers=proposers)
    rows = res["aggregates"]["setA"]
    assert all(rows[n]["mismatches"] == 0 and rows[n]["checked"] == 2 for n in proposers)
    assert rows["ddtree-8"]["tau"] > 1.5
    assert max(a for r in res["records"] if r["method"] == "ddtree-8" for a in r["accept_lengths"]) > 2


def test_peers_summary_reports_tau_beside_tokens_per_s():
    """bench-peers: τ = tokens the forwards after the prompt's emitted ÷ those forwards, for every system; None for
    rows without the counts (files written before they were recorded)."""
    from drafttree.apps.bench.peers import markdown, summarize

    rows = [dict(dataset="gsm8k", prompt=0, system="llama.cpp-ar", tokens=10, seconds=1.0, verified=9, forwards=9),
            dict(dataset="gsm8k", prompt=0, system="drafttree-lookup", tokens=12, seconds=0.5, verified=11, forwards=4),
            dict(dataset="gsm8k", prompt=1, system="drafttree-lookup", tokens=8, seconds=0.5, verified=9, forwards=4),
            dict(dataset="gsm8k", prompt=0, system="old", tokens=5, seconds=1.0)]
    table = summarize(rows, ["llama.cpp-ar", "drafttree-lookup", "old"], ["gsm8k"])
    lookup = table["all"]["drafttree-lookup"]
    assert lookup["tau"] == 20 / 8 and lookup["tokens_per_s"] == 20.0 and lookup["vs_llama_cpp"] == 2.0
    assert table["gsm8k"]["llama.cpp-ar"]["tau"] == 1.0 and table["all"]["old"]["tau"] is None
    config = dict(model="m", threads=2, cpu="c", isa="i", compute="q4", compute_reason="r", torch="t", llama_cpp="l",
                  limit=2, max_new_tokens=8)
    text = markdown(dict(config=config, table=table, bandwidth_gbs=1.0, floors_ms={"fp32": 1.0}))
    assert "20.0 (2.00×, τ 2.50)" in text and "5.0 (0.50×) |" in text


def test_llama_speculative_log_is_parsed():
    """The figures llama-speculative-simple prints at its end (a real log of the pinned llama.cpp, trimmed)."""
    from drafttree.apps.bench.llama_tools import parse_speculative_log

    log = """0.00.977.658 I encoded   39 tokens in    0.149 seconds, speed:  261.638 t/s
0.00.977.727 I decoded   65 tokens in    0.518 seconds, speed:  125.392 t/s
0.00.977.870 I n_predict = 65
0.00.978.222 I target:

0.00.978.379 I common_perf_print: prompt eval time =     158.31 ms /    41 tokens (    3.86 ms per token,   258.99 tokens per second)
0.00.978.435 I common_perf_print:        eval time =     494.66 ms /    64 runs   (    7.73 ms per token,   129.38 tokens per second)
"""
    run = parse_speculative_log(log)
    assert (run.tokens, run.seconds, run.forwards) == (65, 0.518, 64)
    # with drafts: verified drafts are batches (prompt eval); forwards from n_predict and n_accept
    drafted = """0.06.259.085 I decoded  128 tokens in    5.394 seconds, speed:   23.732 t/s
0.06.259.198 I n_predict = 128
0.06.259.235 I n_drafted = 855
0.06.259.272 I n_accept  = 67
0.06.259.510 I target:

0.06.259.705 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""
    run = parse_speculative_log(drafted)
    assert (run.tokens, run.seconds, run.forwards) == (128, 5.394, 60)
    with pytest.raises(ValueError, match="no decode summary"):
        parse_speculative_log("error: the model could not be loaded")


def test_llama_cpp_builds_without_amx_only_on_amx_cpus(monkeypatch):
    """llama.cpp's AMX matmul dies with SIGILL on an Emerald Rapids: the peer is built without it there (and its
    binary cached apart), natively everywhere else."""
    from drafttree.apps.bench import llama_tools
    from drafttree.compute import CpuInfo

    def cpu(*flags):
        return CpuInfo(model="m", arch="x86_64", flags=frozenset(flags), restricted_to_avx2=False)

    monkeypatch.setattr("drafttree.compute.cpu_info", lambda: cpu("avx2", "avx512f", "avx512_vnni", "amx_int8"))
    assert "-DGGML_NATIVE=OFF" in llama_tools.ggml_cpu_flags() and "build-no-amx" in str(llama_tools.tool_path())
    assert not any("AMX" in f for f in llama_tools.ggml_cpu_flags())
    monkeypatch.setattr("drafttree.compute.cpu_info", lambda: cpu("avx2", "avx512f", "avx512_vnni"))
    assert llama_tools.ggml_cpu_flags() == ["-DGGML_NATIVE=ON"] and llama_tools.tool_path().parent.parent.name == "build"


def test_llama_cpp_tools_share_one_build_tree(monkeypatch, tmp_path):
    """A second tool (llama-server after llama-speculative-simple) is one more target in the cached tree; a tree
    configured from another source (an older cache layout) is rebuilt; no binary after the build is an error."""
    from drafttree.apps.bench import llama_tools

    monkeypatch.setattr(llama_tools, "tool_dir", lambda: tmp_path)
    monkeypatch.setattr(llama_tools, "ggml_cpu_flags", lambda: llama_tools.NATIVE)
    (tmp_path / "source").mkdir()
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path / 'source'}\n")
    (build / "kept.o").write_text("")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if "--build" in cmd:
            (build / "bin").mkdir(parents=True, exist_ok=True)
            (build / "bin" / cmd[cmd.index("--target") + 1]).write_text("")

    monkeypatch.setattr(llama_tools.subprocess, "run", run)
    assert llama_tools.build_tool("llama-server") == build / "bin" / "llama-server"
    assert (build / "kept.o").exists() and "-DLLAMA_BUILD_SERVER=ON" in calls[0]
    assert llama_tools.build_tool("llama-server") == build / "bin" / "llama-server" and len(calls) == 2  # cached
    (build / "CMakeCache.txt").write_text("CMAKE_HOME_DIRECTORY:INTERNAL=/gone/tmp/llama.cpp\n")
    llama_tools.build_tool("llama-speculative-simple")
    assert not (build / "kept.o").exists()
    monkeypatch.setattr(llama_tools.subprocess, "run", lambda cmd, **kw: None)
    with pytest.raises(RuntimeError, match="without"):
        llama_tools.build_tool("llama-bench")


def test_bench_peers_refuses_a_llama_cpp_with_amx_on_an_amx_cpu(monkeypatch, tmp_path):
    from drafttree.apps.bench.peers import _check_llama_cpp_build
    from drafttree.compute import CpuInfo

    (tmp_path / "libggml-cpu.so").write_bytes(b"\0ggml_backend_amx_mul_mat\0")
    amx = CpuInfo(model="m", arch="x86_64", flags=frozenset({"avx512_vnni", "amx_int8"}), restricted_to_avx2=False)
    monkeypatch.setattr("drafttree.compute.cpu_info", lambda: amx)
    with pytest.raises(ValueError, match="CMAKE_ARGS=.*GGML_NATIVE=OFF"):
        _check_llama_cpp_build(tmp_path)
    (tmp_path / "libggml-cpu.so").write_bytes(b"\0ggml_vec_dot_q4_1\0")
    _check_llama_cpp_build(tmp_path)  # a build without AMX passes
