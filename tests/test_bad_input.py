"""Bad input fails fast, with one line that names the problem, exit code 2, no model loaded and no file left."""
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafttree import cli
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


def test_check_lossless_run_checks_before_loading(monkeypatch):
    """The same refusals when run() is called directly, without the CLI's checks."""
    from drafttree.bench import lossless

    monkeypatch.setattr("drafttree.load.load_target", lambda *a, **k: pytest.fail("model loaded"))
    base = dict(methods="chain", datasets="gsm8k", limit=None, max_new_tokens=8, budget=16)
    for bad, word in [(dict(limit=0), "--limit"), (dict(limit=-3), "--limit"), (dict(methods=""), "empty"),
                      (dict(max_new_tokens=0), "--max-new-tokens"), (dict(datasets=""), "no prompts")]:
        with pytest.raises(InputError, match=word):
            lossless.run(SimpleNamespace(**{**base, **bad}))


def test_check_lossless_fails_when_nothing_was_checked(monkeypatch, tmp_path, capsys):
    from drafttree.bench import lossless

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
    if "layers" in changes:
        d["dflash_config"] = {**d["dflash_config"], "target_layer_ids": changes["layers"]}
    return d


@pytest.mark.parametrize("changes, words", [
    (dict(block_size=1000), ["block_size", "1000"]), (dict(block_size=1), ["block_size"]),
    (dict(block_size=8.5), ["block_size"]), (dict(layers=[0, 1.5]), ["target_layer_ids", "1.5"]),
    (dict(layers=[0, -1]), ["target_layer_ids"]), (dict(layers=[2, 2]), ["duplicates"]),
    (dict(hidden_size=0), ["hidden_size"]),
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
    from drafttree.bench.replay import load_streams

    bad = tmp_path / "streams.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a draft-stream archive"):
        load_streams(bad, ["gsm8k"])


def test_demo_takes_a_drafter_directory():
    from drafttree.cli import build_parser

    assert build_parser().parse_args(["demo", "--drafter", "some/dir"]).drafter == "some/dir"


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
