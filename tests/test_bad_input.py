"""Bad input fails fast, with one line that names the problem, exit code 2, no model loaded and no file left."""
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafttree.apps import cli
from drafttree.atomic import atomic_path
from drafttree.costmodel import ConvexCost, CostModelError, VerifyCostModel
from drafttree.drafter.checkpoint import config_from_dict, load_drafter, save_drafter
from drafttree.drafter.model import DFlashDrafter
from drafttree.sampling import SamplingParams
from drafttree.validate import InputError, check_model_dir, check_threads


def _files(root: Path) -> set:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.fixture
def run_cli(tmp_path, monkeypatch, capsys):
    """main(argv) in a clean directory with the cache in it; fails the test if a model is loaded or a
    file appears. Returns (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTTREE_CACHE", str(tmp_path / "cache"))

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("drafttree.load.load_target", no_model)

    def run(*argv):
        before = _files(tmp_path)
        capsys.readouterr()
        code = cli.main(list(argv))
        err = capsys.readouterr().err
        assert _files(tmp_path) == before, "files left behind"
        return code, err

    return run


def _assert_one_line_error(code, err, *words):
    assert code == 2
    assert err.startswith("drafttree: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("option, value, word", [
    ("--temperature", "nan", "temperature"), ("--temperature", "inf", "temperature"),
    ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
    ("--top-k", "-1", "top_k"), ("--threads", "-1", "threads"), ("--threads", "0", "threads"),
    ("--max-new-tokens", "0", "--max-new-tokens"), ("--budget", "0", "--budget"),
])
def test_generate_refuses_bad_options(run_cli, option, value, word):
    _assert_one_line_error(*run_cli("generate", "hi", option, value), word, value)


@pytest.mark.parametrize("command", ["check-lossless", "bench"])
@pytest.mark.parametrize("args, words", [
    (["--limit", "0"], ["--limit", "0"]), (["--limit", "-3"], ["--limit", "-3"]),
    (["--methods", ""], ["--methods", "empty"]), (["--methods", " , "], ["--methods", "empty"]),
    (["--methods", "chain,fast"], ["fast"]), (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--datasets", "gsm8k,nope"], ["nope"]), (["--threads", "0"], ["threads"]),
])
def test_prompt_set_commands_refuse_an_empty_or_invalid_selection(run_cli, command, args, words):
    _assert_one_line_error(*run_cli(command, *args), *words)


def test_bench_max_tree_nodes_checked_before_profiling(run_cli):
    """It failed after 117 s of profiling, having written a cost model; now: at once, nothing written."""
    _assert_one_line_error(*run_cli("bench", "--max-tree-nodes", "-1"), "--max-tree-nodes", "-1")
    _assert_one_line_error(*run_cli("bench", "--max-tree-nodes", "0", "--methods", "caddtree"), "--max-tree-nodes")


def test_init_from_a_truncated_drafter(run_cli, tmp_path, train_inputs):
    data, target, run = train_inputs
    import shutil

    shutil.copytree(run / "drafter", tmp_path / "init")
    _truncate(tmp_path / "init" / "model.safetensors")
    _assert_one_line_error(*run_cli(*_train(data, target, tmp_path / "out", "--init-from", str(tmp_path / "init"))),
                           "--init-from", "truncated")


def test_check_lossless_run_checks_before_loading(monkeypatch):
    """The same refusals when run() is called directly, without the CLI's checks."""
    from drafttree.apps.bench import lossless

    monkeypatch.setattr("drafttree.load.load_target", lambda *a, **k: pytest.fail("model loaded"))
    base = dict(methods="chain", datasets="gsm8k", limit=None, max_new_tokens=8, budget=16)
    for bad, word in [(dict(limit=0), "--limit"), (dict(limit=-3), "--limit"), (dict(methods=""), "empty"),
                      (dict(max_new_tokens=0), "--max-new-tokens"), (dict(datasets=""), "no prompts")]:
        with pytest.raises(InputError, match=word):
            lossless.run(SimpleNamespace(**{**base, **bad}))


def test_check_lossless_fails_when_nothing_was_checked(monkeypatch, tmp_path, capsys):
    from drafttree.apps.bench import lossless

    monkeypatch.setattr("drafttree.load.load_target", lambda *a, **k: SimpleNamespace(name="fake"))
    monkeypatch.setattr("drafttree.methods.load_drafter_for", lambda target, path: None)
    monkeypatch.setattr(lossless, "check", lambda *a, **k: {"gsm8k": {}})  # e.g. every method row skipped
    args = SimpleNamespace(methods="chain", datasets="gsm8k", limit=1, max_new_tokens=8, budget=16, dtype="float32",
                           threads=None, model="fake", drafter=None, out=str(tmp_path / "out"))
    assert lossless.run(args) == 1
    assert "no prompt was checked" in capsys.readouterr().err


def test_debug_shows_the_traceback(run_cli):
    for argv in (["--debug", "generate", "hi", "--top-p", "0"], ["generate", "hi", "--top-p", "0", "--debug"]):
        with pytest.raises(InputError, match="top_p"):
            cli.main(argv)


def test_sampling_params_refuse_nan_and_inf():
    for bad in (dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan), dict(top_k=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(temperature=0.7, top_p=0.9, top_k=50)


def test_more_threads_than_cores_warns(capsys):
    assert check_threads(os.cpu_count() + 1) == os.cpu_count() + 1
    assert "threads" in capsys.readouterr().err


# ---- files: model config, cost model, drafter config -----------------------------------------------


def test_model_config_that_is_not_json(run_cli, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 6')  # truncated
    _assert_one_line_error(*run_cli("generate", "hi", "--model", str(model)), "config.json", "not valid JSON")
    (model / "config.json").write_bytes(b"\xff\xfe garbage")
    _assert_one_line_error(*run_cli("generate", "hi", "--model", str(model)), "config.json", "not valid JSON")


def test_a_good_model_dir_passes_the_check(tiny_checkpoint):
    check_model_dir(str(tiny_checkpoint[0]))  # no false alarm on a real checkpoint


def _cost_model_dict():
    curve = ConvexCost((1, 16, 64), (10.0, 12.0, 30.0))
    return VerifyCostModel([0, 512], [curve, curve], 3.0, 0.001).to_dict()


@pytest.mark.parametrize("corrupt, words", [
    (lambda text, d: text[: len(text) // 2], ["not valid JSON", "truncated"]),
    (lambda text, d: json.dumps({**d, "draft_ms": math.nan}), ["draft_ms", "finite"]),
    (lambda text, d: json.dumps({**d, "curves": [{"knots": [1, 2], "values": [1.0, math.nan]}] * 2}), ["finite"]),
    (lambda text, d: json.dumps({k: v for k, v in d.items() if k != "curves"}), ["lacks the key 'curves'"]),
    (lambda text, d: json.dumps({**d, "curves": [{"knots": [1, 64], "values": [5.0, 5.0]}] * 2}), ["flat"]),
    (lambda text, d: json.dumps({**d, "draft_ms": 1e9}), ["draft_ms"]),
    (lambda text, d: "[1, 2]", ["not a usable cost model"]),
])
def test_broken_cost_model(run_cli, tmp_path, corrupt, words):
    path = tmp_path / "cost.json"
    d = _cost_model_dict()
    path.write_text(corrupt(json.dumps(d), d))
    with pytest.raises(CostModelError, match="drafttree profile") as e:
        VerifyCostModel.load(path)
    assert str(path) in str(e.value)
    for command in ("bench", "replay"):  # checked before the model loads
        _assert_one_line_error(*run_cli(command, "--cost-model", str(path)), str(path), "drafttree profile", *words)


def test_missing_cost_model_file(run_cli, tmp_path):
    _assert_one_line_error(*run_cli("bench", "--cost-model", str(tmp_path / "nope.json")), "nope.json")


def test_cost_model_save_is_atomic(tmp_path):
    path = tmp_path / "cost.json"
    VerifyCostModel.from_dict(_cost_model_dict()).save(path)
    assert VerifyCostModel.load(path).to_dict() == _cost_model_dict()
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:  # a writer that dies half-way
            tmp.write_text("{half")
            raise RuntimeError
    assert VerifyCostModel.load(path).to_dict() == _cost_model_dict() and _files(tmp_path) == {Path("cost.json")}


def _drafter_config(**changes) -> dict:
    d = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "block_size": 8,
         "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 3}}
    d.update({k: v for k, v in changes.items() if k != "layers"})
    d = {k: v for k, v in d.items() if v is not None}  # None: the key is missing
    if "layers" in changes:
        d["dflash_config"] = {**d["dflash_config"], "target_layer_ids": changes["layers"]}
    return d


@pytest.mark.parametrize("changes, words", [
    (dict(block_size=1000), ["block_size", "1000"]), (dict(block_size=1), ["block_size"]),
    (dict(block_size=8.5), ["block_size"]), (dict(layers=[0, 1.5]), ["target_layer_ids", "1.5"]),
    (dict(layers=[0, -1]), ["target_layer_ids"]), (dict(layers=[2, 2]), ["duplicates"]),
    (dict(hidden_size=0), ["hidden_size"]), (dict(vocab_size=None), ["lacks the key 'vocab_size'"]),
])
def test_bad_drafter_config(run_cli, tmp_path, changes, words):
    with pytest.raises(InputError, match=words[0]):
        config_from_dict(_drafter_config(**changes))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(_drafter_config(**changes)))
    _assert_one_line_error(*run_cli("generate", "hi", "--method", "chain", "--drafter", str(drafter)),
                           str(drafter / "config.json"), *words)


def test_drafter_config_not_json_and_large_block_warning(run_cli, tmp_path, capsys):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{")
    _assert_one_line_error(*run_cli("generate", "hi", "--method", "chain", "--drafter", str(drafter)),
                           "config.json", "not valid JSON")
    assert config_from_dict(_drafter_config(block_size=48)).block_size == 48
    assert "block_size 48 is large" in capsys.readouterr().err


def test_saved_drafter_leaves_only_its_two_files(tmp_path):
    cfg = config_from_dict(_drafter_config())
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "d")
    assert _files(tmp_path / "d") == {Path("config.json"), Path("model.safetensors")}
    assert load_drafter(tmp_path / "d").config == cfg


def test_stale_conversion_temporaries_are_removed(tmp_path):
    from drafttree.gguf_convert import _remove_stale_temporaries

    old, fresh, other = tmp_path / ".m-abc", tmp_path / ".m-def", tmp_path / ".other-abc"
    for d in (old, fresh, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    os.utime(other, (an_hour_ago, an_hour_ago))
    _remove_stale_temporaries(tmp_path, "m")
    assert not old.exists() and fresh.exists() and other.exists()  # a fresh one may be a conversion in progress


def test_replay_streams_that_are_not_an_archive_say_so(tmp_path):
    from drafttree.apps.bench.replay import load_streams

    bad = tmp_path / "streams.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a draft-stream archive"):
        load_streams(bad, ["gsm8k"])


def test_demo_takes_a_drafter_directory():
    from drafttree.apps.cli import build_parser

    assert build_parser().parse_args(["demo", "--drafter", "some/dir"]).drafter == "some/dir"


def test_demo_repeats_must_be_positive(run_cli):
    from drafttree.apps.cli import build_parser

    assert build_parser().parse_args(["demo"]).repeats == 3
    _assert_one_line_error(*run_cli("demo", "--repeats", "0"), "--repeats", ">= 1")


# ---- token ids (the Python API: validate.check_token_ids) --------------------------------------------


def test_check_token_ids_accepts_integer_sequences():
    import numpy as np

    from drafttree.validate import check_token_ids

    for ids in ([1, 2, 3], (1, 2, 3), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32),
                [torch.tensor(1), np.int64(2), 3], np.array([1, 2, 3])):
        out = check_token_ids(ids, 10)
        assert out.dtype == torch.long and out.tolist() == [1, 2, 3]
    assert check_token_ids([0, 9], 10).tolist() == [0, 9]  # both ends of the vocabulary


@pytest.mark.parametrize("ids, words", [
    ([1, 2.0, 3], ["integers", "float", "position 1"]), ([1, True], ["integers", "bool", "position 1"]),
    (torch.tensor([1.0, 2.0]), ["integers", "torch.float32"]), (torch.tensor([True, False]), ["integers", "torch.bool"]),
    ([torch.tensor(1.5)], ["integers", "float32"]), ([torch.tensor(True)], ["integers", "bool"]),
    ([[1, 2], [3, 4]], ["1-D"]), (torch.tensor([[1, 2]]), ["1-D", "(1, 2)", "ids[0]"]),
    ([], ["empty"]), (torch.tensor([], dtype=torch.long), ["empty"]),
    ([3, -1], ["-1", "position 1", "negative"]), (torch.tensor([3, -1]), ["-1", "negative"]),
    ([3, 10], ["10", "position 1", ">= the vocabulary size 10"]), (torch.tensor([10]), ["10", "vocabulary size 10"]),
    ([2 ** 70], ["vocabulary size"]), ("hello", ["text", "encode"]), (None, ["list, tuple or tensor"]),
])
def test_check_token_ids_refuses(ids, words):
    from drafttree.validate import check_token_ids

    with pytest.raises(InputError) as e:
        check_token_ids(ids, 10)
    assert str(e.value).startswith("prompt ")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_check_token_ids_names_what_it_checks():
    from drafttree.validate import check_token_ids

    with pytest.raises(InputError, match="^reply token id 12"):
        check_token_ids([12], 10, what="reply")
    with pytest.raises(InputError, match="vocab_size"):
        check_token_ids([1], 0)


# ---- output and cache paths: checked before any work ---------------------------------------------


def _write_fails(folder: Path) -> bool:
    try:
        (folder / ".probe").write_text("x")
    except OSError:
        return True
    (folder / ".probe").unlink()
    return False


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no file can be created in: a chmod 555 directory, or (as root, whom permission bits do not
    stop) /sys, where even root cannot create files."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if _write_fails(ro):
            yield ro
        elif Path("/sys").is_dir() and _write_fails(Path("/sys")):
            yield Path("/sys")
        else:
            pytest.skip("no read-only place here")
    finally:
        ro.chmod(0o755)


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    return f


@pytest.mark.parametrize("argv, words", [
    (["profile", "--out", "{file}/cost.json"], ["--out", "a_file is a file, not a directory"]),
    (["profile", "--out", "{ro}/cost.json"], ["--out", "not writable", "cannot create files"]),
    (["profile", "--out", "{tmp}"], ["--out", "is a directory, not a file"]),
    (["bench", "--out", "{file}"], ["--out", "is a file, not a directory"]),
    (["bench", "--out", "{ro}/bench"], ["--out", "not writable"]),
    (["bench-runtime", "--out", "{ro}/x"], ["--out", "not writable"]),
    (["check-lossless", "--out", "{file}/sub"], ["--out", "is a file, not a directory"]),
    (["replay", "--out", "{file}"], ["--out", "is a file"]),
    (["bench-peers", "--out", "{ro}/peers"], ["--out", "not writable"]),
    (["train", "drafter", "--data", "d", "--target", "t", "--out", "{file}"], ["--out", "is a file"]),
    (["train", "data", "--out", "{ro}/data"], ["--out", "not writable"]),
])
def test_unwritable_out_fails_before_any_work(run_cli, tmp_path, read_only_dir, a_file, argv, words):
    argv = [x.format(file=a_file, ro=read_only_dir, tmp=tmp_path) for x in argv]
    _assert_one_line_error(*run_cli(*argv), *words)


def test_read_only_or_file_typed_cache_fails_before_the_conversion(run_cli, monkeypatch, read_only_dir, a_file):
    for cache in (read_only_dir / "cache", a_file):
        monkeypatch.setenv("DRAFTTREE_CACHE", str(cache))
        for argv in (["generate", "hi"], ["demo"], ["train", "data", "--out", "d"],
                     ["train", "drafter", "--data", "d", "--target", "smollm2-135m-instruct", "--out", "o"]):
            _assert_one_line_error(*run_cli(*argv), "the model cache", "DRAFTTREE_CACHE")


def test_full_cache_fails_before_the_conversion(run_cli, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 50_000_000, 50_000_000))
    _assert_one_line_error(*run_cli("generate", "hi"), "the model cache", "full", "50.0 MB free", "600 MB needed")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    _assert_one_line_error(*run_cli("bench", "--out", "results"), "--out", "full")


@pytest.fixture
def model_dir(tmp_path):
    """A checkpoint directory as far as the checks before loading go (not the embedded model: no conversion)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    return d


@pytest.mark.parametrize("argv, fix", [
    (["generate", "hi", "--method", "caddtree"], None), (["demo"], None),  # demo: lookup-caddtree-online by default
    (["bench", "--methods", "ar,caddtree", "--limit", "1", "--out", "{tmp}/out"], "--cost-model FILE"),
    (["check-lossless", "--methods", "caddtree-online", "--limit", "1", "--out", "{tmp}/out"], None),
    (["profile"], "--out FILE"),
])
def test_first_caddtree_run_with_a_read_only_cache_fails_before_profiling(run_cli, monkeypatch, tmp_path, read_only_dir,
                                                                          model_dir, argv, fix):
    monkeypatch.setenv("DRAFTTREE_CACHE", str(read_only_dir / "cache"))
    argv = [x.format(tmp=tmp_path) for x in argv] + ["--model", str(model_dir), "--compute", "fp32"]
    code, err = run_cli(*argv)
    _assert_one_line_error(code, err, "the cost-model cache", "costmodels", "not writable", "DRAFTTREE_CACHE",
                           "profiled once", *([fix] if fix else []))


def test_first_caddtree_run_from_the_python_api_with_a_read_only_cache(monkeypatch, read_only_dir, tiny_checkpoint):
    from drafttree.load import load_target
    from drafttree.methods import make_proposer
    from drafttree.validate import InputError
    from spec_helpers import random_drafter_for

    monkeypatch.setenv("DRAFTTREE_CACHE", str(read_only_dir / "cache"))
    target = load_target(str(tiny_checkpoint[0]))
    with pytest.raises(InputError, match="cost-model cache .* not writable"):
        make_proposer("caddtree", target, random_drafter_for(target.model))


def test_truncated_drafter_from_the_python_api(tmp_path):
    from drafttree.drafter.checkpoint import load_drafter
    from drafttree.methods import SHIPPED_DRAFTERS
    from drafttree.validate import InputError

    src = SHIPPED_DRAFTERS["smollm2-135m-instruct"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:100_000])
    with pytest.raises(InputError, match="unreadable, perhaps truncated"):
        load_drafter(tmp_path)


def test_unbuilt_kernels_with_a_read_only_cache(run_cli, monkeypatch, capsys, read_only_dir, model_dir):
    monkeypatch.setenv("DRAFTTREE_CACHE", str(read_only_dir / "cache"))
    for compute in ("q4", "int8"):
        _assert_one_line_error(*run_cli("generate", "hi", "--model", str(model_dir), "--compute", compute),
                               "the kernel cache", "not writable", "DRAFTTREE_CACHE", "--compute fp32")
    capsys.readouterr()
    cli.check_args(cli.build_parser().parse_args(["generate", "hi", "--model", str(model_dir)]))  # auto: a warning
    err = capsys.readouterr().err
    assert "warning: the kernel cache" in err and "falls back to a float path" in err, err
    cli.check_args(cli.build_parser().parse_args(["generate", "hi", "--model", str(model_dir), "--compute", "fp32"]))


def test_a_cached_cost_model_needs_no_writable_cache(monkeypatch, tmp_path, model_dir):
    """No false alarm: with this machine's cost model in the cache (or --cost-model given), nothing is written."""
    from drafttree import validate
    from drafttree.compute import cpu_info

    monkeypatch.setenv("DRAFTTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    checked = []
    monkeypatch.setattr(validate, "check_writable",
                        lambda path, what, **k: checked.append(what) if "cost-model" in what else None)
    from drafttree.methods import COST_MODEL_VERSION
    from drafttree.ops.cpu_extension import build_name

    kernels = f"{cpu_info().int8_isa}-{build_name()}"  # the kernel build is part of a kernel path's name
    v = COST_MODEL_VERSION
    for compute, name in (("auto", f"model-q4-{kernels}-t3-v{v}.json"), ("fp32", f"model-fp32-t3-v{v}.json")):
        argv = ["generate", "hi", "--method", "caddtree", "--model", str(model_dir), "--compute", compute]
        cli.check_args(cli.build_parser().parse_args(argv))
        assert checked == ["the cost-model cache"], checked  # nothing cached yet: checked
        checked.clear()
        (tmp_path / "cache" / "costmodels").mkdir(parents=True, exist_ok=True)
        (tmp_path / "cache" / "costmodels" / name).write_text("{}")
        cli.check_args(cli.build_parser().parse_args(argv))
        assert checked == [], checked
    cli.check_args(cli.build_parser().parse_args(["generate", "hi", "--method", "chain", "--model", str(model_dir)]))
    assert checked == []  # chain profiles nothing


# ---- other command-line input ---------------------------------------------------------------------


def test_prompt_that_is_not_utf8(run_cli):
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python hands over undecodable argv bytes
    _assert_one_line_error(*run_cli("generate", bad), "prompt", "not valid UTF-8", "0xe9")
    _assert_one_line_error(*run_cli("generate", "hi", "--system", bad), "--system", "not valid UTF-8")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_drafter_and_model_weights(run_cli, tmp_path):
    cfg = config_from_dict(_drafter_config())
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "drafter")
    _truncate(tmp_path / "drafter" / "model.safetensors")
    _assert_one_line_error(*run_cli("generate", "hi", "--method", "chain", "--drafter", str(tmp_path / "drafter")),
                           "model.safetensors", "drafter's weights", "truncated")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes((tmp_path / "drafter" / "model.safetensors").read_bytes())
    _assert_one_line_error(*run_cli("generate", "hi", "--model", str(model)), "model's weights", "truncated")


@pytest.mark.parametrize("args, words", [
    (["--sizes", "0"], ["--sizes", ">= 1", "'0'"]), (["--sizes", "1,a"], ["--sizes", "integers"]),
    (["--sizes", ""], ["--sizes"]), (["--contexts", "-5"], ["--contexts", ">= 0"]),
    (["--curve-dtypes", "fp16"], ["--curve-dtypes", "fp16", "bf16, fp32"]), (["--curve-dtypes", ""], ["--curve-dtypes"]),
    (["--skip-ar", "--skip-curve"], ["nothing to measure"]), (["--repeats", "0"], ["--repeats"]),
    (["--prompts", "0"], ["--prompts"]),
])
def test_bench_runtime_refuses_bad_options(run_cli, monkeypatch, args, words):
    monkeypatch.setattr("drafttree.gguf_convert.convert_embedded", lambda *a, **k: pytest.fail("converted first"))
    _assert_one_line_error(*run_cli("bench-runtime", *args), *words)


# ---- train drafter / train data ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    """(data dir, target dir) of the synthetic training set of test_drafter_train, and a run interrupted at
    step 2 (checkpoint to resume)."""
    from drafter_helpers import synthetic

    from drafttree.training.train import main as train_main

    root = tmp_path_factory.mktemp("train")
    data, target, _ = synthetic(root)
    train_main(["--data", str(data), "--target", str(target), "--out", str(root / "run"), "--block-size", "4",
                "--steps", "4", "--stop-at", "2", "--checkpoint-every", "2", "--log-every", "2", "--seqs-per-step", "2"])
    return data, target, root / "run"


def _train(data, target, out, *extra):
    return ["train", "drafter", "--data", str(data), "--target", str(target), "--out", str(out), "--block-size", "4",
            "--steps", "4", "--log-every", "2", "--checkpoint-every", "2", "--seqs-per-step", "2", *extra]


@pytest.mark.parametrize("option, value, words", [
    ("--steps", "0", ["--steps", "untrained"]), ("--layers", "0", ["--layers", "at least one layer"]),
    ("--log-every", "0", ["--log-every", ">= 1"]), ("--checkpoint-every", "0", ["--checkpoint-every", ">= 1"]),
    ("--seqs-per-step", "0", ["--seqs-per-step", ">= 1"]), ("--blocks-per-seq", "0", ["--blocks-per-seq"]),
    ("--ce-chunk-rows", "0", ["--ce-chunk-rows"]), ("--steps", "-3", ["--steps"]),
    ("--lr", "nan", ["--lr", "finite"]), ("--lr", "0", ["--lr", "> 0"]), ("--min-lr-ratio", "2", ["--min-lr-ratio"]),
    ("--grad-clip", "-1", ["--grad-clip"]), ("--loss-decay-gamma", "inf", ["--loss-decay-gamma"]),
    ("--block-size", "1", ["--block-size", ">= 2"]), ("--block-size", "1000", ["--block-size", "<= 64"]),
    ("--warmup-steps", "-1", ["--warmup-steps"]), ("--draft-vocab", "-1", ["--draft-vocab"]),
    ("--threads", "-1", ["--threads"]), ("--stop-at", "0", ["--stop-at"]), ("--max-context", "0", ["--max-context"]),
    ("--bf16", "maybe", ["--bf16"]), ("--heldout", "no-such-dir", ["--heldout", "not a directory"]),
])
def test_train_drafter_refuses_bad_options(run_cli, monkeypatch, tmp_path, train_inputs, option, value, words):
    monkeypatch.setattr("drafttree.training.train.load_target_head", lambda *a, **k: pytest.fail("target read first"))
    monkeypatch.setattr("drafttree.training.train.FeatureDataset", lambda *a, **k: pytest.fail("data read first"))
    data, target, _ = train_inputs
    _assert_one_line_error(*run_cli(*_train(data, target, tmp_path / "out", option, value)), *words)


def test_train_drafter_without_data(run_cli, tmp_path, train_inputs):
    _, target, _ = train_inputs
    _assert_one_line_error(*run_cli(*_train(tmp_path / "nope", target, tmp_path / "out")), "--data", "train data")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(*run_cli(*_train(tmp_path / "empty", target, tmp_path / "out")), "no .safetensors", "train data")


def test_truncated_or_foreign_training_shard(run_cli, tmp_path, train_inputs):
    import shutil

    data, target, _ = train_inputs
    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    shard = bad / "features-00001.safetensors"
    _truncate(shard)
    _assert_one_line_error(*run_cli(*_train(bad, target, tmp_path / "out")), str(shard), "truncated", "delete",
                           "train data")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(shard))
    _assert_one_line_error(*run_cli(*_train(bad, target, tmp_path / "out")), str(shard), "not a drafttree feature shard")


def test_training_data_with_token_ids_beyond_the_vocabulary(run_cli, tmp_path, train_inputs):
    import shutil

    from drafttree.training.data import write_feature_shard
    from drafter_helpers import LAYER_IDS, V, H

    data, target, _ = train_inputs
    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    ids = torch.arange(10) + V - 5  # the last five are >= the target's vocabulary
    write_feature_shard(bad / "features-00009.safetensors", [(ids, torch.zeros(10, 3 * H), torch.ones(10))], LAYER_IDS)
    _assert_one_line_error(*run_cli(*_train(bad, target, tmp_path / "out")), "features-00009.safetensors",
                           f"token id {V}", f"vocabulary of {V}", "another model", "train data")


@pytest.mark.parametrize("broken, words", [
    ("trainer_state.json", ["trainer_state.json", "truncated", "--no-resume"]),
    ("optimizer.safetensors", ["optimizer.safetensors", "truncated", "--no-resume"]),
    ("model.safetensors", ["checkpoint", "cannot be loaded", "--no-resume"]),
    ("config.json", ["checkpoint", "not valid JSON", "--no-resume"]),
])
def test_truncated_resume_state(run_cli, tmp_path, train_inputs, broken, words):
    import shutil

    data, target, run = train_inputs
    out = tmp_path / "run"
    shutil.copytree(run, out)
    _truncate(out / "checkpoint" / broken)
    _assert_one_line_error(*run_cli(*_train(data, target, out)), *words)


def test_resume_after_a_kill_between_the_checkpoint_renames(tmp_path, train_inputs):
    """_write_checkpoint renames checkpoint -> checkpoint.old, then checkpoint.tmp -> checkpoint: a kill in
    between leaves only checkpoint.old, which is whole, and the next run resumes from it."""
    import shutil

    from drafttree.training.train import main as train_main

    data, target, run = train_inputs
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "checkpoint").rename(out / "checkpoint.old")
    train_main(_train(data, target, out, "--stop-at", "3")[2:])
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3 and [m["step"] for m in state["metrics"]] == [2, 3]  # resumed at 2, not from 0
    assert not (out / "checkpoint.old").exists()


def test_stale_partial_shards_are_removed(tmp_path):
    from drafttree.training.data import FeatureShardWriter

    old, fresh = tmp_path / "features-00000.safetensors.partial", tmp_path / "features-00001.safetensors.partial"
    for p in (old, fresh):
        p.write_bytes(b"half a shard")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    FeatureShardWriter(tmp_path, [0])
    assert not old.exists() and fresh.exists()  # a fresh one may be a writer at work


@pytest.mark.parametrize("args, words", [
    (["--code", "0"], ["no prompt source", "--gsm8k", "--code"]),
    (["--gsm8k", "../shared/data/gsm8k/train.jsonl"], ["--gsm8k", "no such file", "grade-school-math"]),
    (["--batch", "0"], ["--batch"]), (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--limit", "0"], ["--limit"]), (["--code", "-1"], ["--code"]), (["--sampled-fraction", "2"], ["--sampled-fraction"]),
    (["--sampled-fraction", "nan"], ["--sampled-fraction"]), (["--layers", "1,x"], ["--layers"]),
    (["--layers", "1,1"], ["--layers", "distinct"]), (["--layers", ""], ["--layers"]), (["--threads", "0"], ["threads"]),
    (["--part", "2/2"], ["--part", "K/N"]), (["--part", "half"], ["--part", "K/N"]),
    (["--engine", "packed", "--top-k", "4"], ["--top-k", "--engine drafttree or hf"]), (["--compute", "q5"], ["--compute", "q4"]), (["--top-k", "-1"], ["--top-k"]),
    (["--skip-seen", "nope.json"], ["--skip-seen", "data manifest"]), (["--package-code", "-1"], ["--package-code"]),
    (["--package-code", "5", "--code-packages", "numpy,leftpad"], ["--code-packages", "leftpad", "licence"]),
])
def test_train_data_refuses_bad_options(run_cli, monkeypatch, args, words):
    monkeypatch.setattr("drafttree.training.datagen.stdlib_code_prompts", lambda *a, **k: pytest.fail("prompts read first"))
    _assert_one_line_error(*run_cli("train", "data", "--out", "data", *args), *words)


def test_train_data_with_an_empty_or_broken_gsm8k_file(run_cli, tmp_path):
    gsm = tmp_path / "train.jsonl"
    gsm.write_text("\n")
    _assert_one_line_error(*run_cli("train", "data", "--out", "data", "--code", "0", "--gsm8k", str(gsm)),
                           "no training prompts")
    gsm.write_text('{"question": "1+1?", "answer": "2"}\n{"answer": "3"}\n')
    _assert_one_line_error(*run_cli("train", "data", "--out", "data", "--code", "0", "--gsm8k", str(gsm)),
                           "line 2", "question")


# ---- notices go to stderr, never into the generated text --------------------------------------------


def test_first_conversion_says_so_on_stderr_and_leaves_nothing_when_it_fails(monkeypatch, tmp_path, capsys):
    import gguf

    from drafttree.gguf_convert import convert_embedded

    monkeypatch.setenv("DRAFTTREE_CACHE", str(tmp_path / "cache"))

    def killed(*a, **k):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C during the conversion

    monkeypatch.setattr(gguf, "GGUFReader", killed)
    with pytest.raises(KeyboardInterrupt):
        convert_embedded("smollm2-135m-instruct")
    out, err = capsys.readouterr()
    assert out == "" and "converting" in err and "once" in err
    assert list((tmp_path / "cache").iterdir()) == []  # no half-converted model, no temporary directory


def test_profiling_notice_goes_to_stderr(monkeypatch, tmp_path, capsys):
    from drafttree import methods

    monkeypatch.setenv("DRAFTTREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("drafttree.profile.profile_costs", lambda *a, **k: VerifyCostModel.from_dict(_cost_model_dict()))
    target = SimpleNamespace(name="tiny", compute=None, compute_path="fp32")
    model = methods.load_or_profile_cost_model(target, None)
    out, err = capsys.readouterr()
    assert out == "" and "profiling into" in err and str(methods.cost_model_path(target)) in err
    assert methods.load_or_profile_cost_model(target, None).to_dict() == model.to_dict()  # cached: not profiled twice


def test_a_passive_openmp_wait_policy_is_pointed_out(monkeypatch, capsys):
    """OMP_WAIT_POLICY=PASSIVE costs every decoding step several times over: loading a model says so, once."""
    import torch

    from drafttree.load import warn_if_threads_sleep

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        warn_if_threads_sleep()
        assert "OMP_WAIT_POLICY=PASSIVE" in capsys.readouterr().err
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        warn_if_threads_sleep()
        assert capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(threads)
