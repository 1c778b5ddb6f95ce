"""`--model file.gguf`: tiny random llama / qwen2 / qwen3 models written as GGUF by the tests (tests/gguf_files.py),
in every type drafttree reads, loaded straight from the file.

Stated tolerances, against a transformers model on the file's weights as gguf.quants.dequantize reads them:
- fp32 path: the same function (relative RMS of the logits ≤ 1e-5): config, layout and RoPE order are read right.
- q4 / int8 paths: relative RMS of the logits ≤ 0.15 (measured 0.001-0.124 over these files) and top-1 agreement
  ≥ 0.7 (measured 0.75-1.0): most of that is the per-row int8 activations these paths always use, on random
  models. The weights' own conversion is checked on its own (Q4_0/Q4_1 exact, Q4_K within the fp16 rounding of its
  scales: 2e-4; int8 rows ≤ 2 %, measured 0.6-0.75 %), and the int8 path gives the same logits, bit for bit, as
  the existing int8 path on a Hugging Face directory of the dequantized weights.
- greedy speculative decoding (`lookup`, the method that needs no trained drafter) equals AR token for token.
"""
import numpy as np
import pytest
import torch

from gguf_files import Q4_K_M, dequantized_reference, random_k_quant, write_tiny_gguf

pytest.importorskip("gguf")
from drafttree.apps.cli import main  # noqa: E402
from drafttree.engine import generate_ar  # noqa: E402
from drafttree.methods import generate  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
FILES = [("llama", t) for t in TYPES] + [("qwen3", t) for t in TYPES] + [("qwen2", "Q8_0"), ("qwen2", "Q4_K_M")]
FUSED = [("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")]  # concatenated into one runtime matrix
PROMPT = torch.tensor([5, 300, 17, 900, 44, 2, 1, 600, 33, 33, 33, 70])


def file_name(arch, weight_type):
    return f"{arch}-{weight_type}"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def tiny_file(gguf_dir, arch, weight_type, **kw):
    path = gguf_dir / f"{file_name(arch, weight_type)}.gguf"
    if not path.exists():
        if weight_type == "Q4_K_M":
            write_tiny_gguf(path, arch, "Q4_K", types=Q4_K_M, **kw)
        else:
            write_tiny_gguf(path, arch, weight_type, **kw)
    return path


def logits_of(target, ids=PROMPT):
    return target.model.forward(target.model.new_state(len(ids) + 1), ids).logits.float()


def reference_logits(path, arch, ids=PROMPT):
    with torch.no_grad():
        return dequantized_reference(path, arch)(ids[None]).logits[0].float()


def relative_rms(a, b):
    return float((a - b).norm() / b.norm())


def agrees_where_decisive(got, want) -> bool:
    """Top-1 equal at every position where the reference's top-1 leads its runner-up by more than 4x the path's RMS
    logit error (a random tiny model has near-ties that any rounding flips)."""
    top = want.topk(2, -1).values
    decisive = (top[:, 0] - top[:, 1]) > 4 * (got - want).pow(2).mean().sqrt()
    return bool((got.argmax(-1) == want.argmax(-1))[decisive].all())


# ---- the conversions themselves -----------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_4_bit_types_carry_over_into_q4_1_blocks(type_name):
    """Q4_0 and Q4_1 exactly; Q4_K up to the fp16 rounding of each 32-block's scale (d·sc) and offset (dmin·m)."""
    import gguf
    from gguf.quants import dequantize, quantize

    from drafttree.model.gguf_model import _q4_1_from
    from drafttree.ops.q4 import dequantize_q4_1

    rng = np.random.default_rng(1)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = (random_k_quant(type_name, 48, 512, rng) if type_name == "Q4_K"
           else quantize(rng.normal(0, 0.2, size=(48, 512)).astype(np.float32), qtype))
    q, d, m = _q4_1_from(raw, type_name)
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    got = dequantize_q4_1(q, d, m)
    if type_name == "Q4_K":
        assert relative_rms(got, want) < 1e-3
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("weight_type", TYPES)
def test_conversion_error_is_measured_per_tensor_kind(gguf_dir, weight_type):
    from drafttree.model.gguf_model import build_gguf_model

    path = tiny_file(gguf_dir, "qwen3", weight_type)
    _, q4 = build_gguf_model(path, "q4", "avx2", quiet=True)
    _, int8 = build_gguf_model(path, "int8", "avx2", quiet=True)
    kinds = {k[0] for k in q4.rows}
    assert kinds == {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    for kind in kinds:
        file_type = (lambda k: Q4_K_M.get(k, "Q4_K")) if weight_type == "Q4_K_M" else (lambda k: weight_type)
        src = file_type(kind)
        fused_with = next((g for g in FUSED if kind in g), (kind,))
        runtime = {dst for (k, _, dst) in q4.rows if k == kind}
        if kind in ("token_embd", "output"):  # the embedding and the head: int8 rows on every kernel path
            assert runtime == {"int8"}
        else:  # a fused matrix is Q4_1 when all its parts are 4-bit (Q4_K_M's attn_v is Q6_K: its qkv goes 8-bit)
            assert runtime == ({"Q4_1"} if all(file_type(k) in ("Q4_0", "Q4_1", "Q4_K") for k in fused_with)
                               else {"8-bit blocks"})
        if src in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1") and runtime != {"int8"}:
            # values and scales carried over as they are (8-bit blocks: the fp32 sum d·q + m may round)
            assert q4.relative_rms(kind) < 1e-6 if runtime == {"8-bit blocks"} else q4.relative_rms(kind) == 0
        else:  # Q4_K's fp16 block scales; more bits than 8-bit blocks per 32 keep (Q6_K, F16, F32)
            assert q4.relative_rms(kind) < (1e-3 if runtime == {"Q4_1"} else 1e-2)
        assert int8.relative_rms(kind) < 2e-2
        print(f"{weight_type} {kind}: q4 path {q4.relative_rms(kind):.1e}, int8 path {int8.relative_rms(kind):.1e}")


# ---- whole models --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,weight_type", FILES, ids=[file_name(*f) for f in FILES])
def test_fp32_path_computes_the_dequantized_model(gguf_dir, arch, weight_type):
    from drafttree.load import load_target

    path = tiny_file(gguf_dir, arch, weight_type)
    target = load_target(str(path), compute="fp32")
    assert relative_rms(logits_of(target), reference_logits(path, arch)) <= 1e-5


@pytest.mark.parametrize("arch,weight_type", FILES, ids=[file_name(*f) for f in FILES])
def test_kernel_path_is_close_and_lookup_equals_ar(gguf_dir, arch, weight_type):
    from drafttree.load import load_target

    path = tiny_file(gguf_dir, arch, weight_type)
    paths = ["q4", "int8"] if weight_type in ("Q4_K", "Q4_K_M", "F16") else ["q4"]
    want = reference_logits(path, arch)
    for compute in paths:
        target = load_target(str(path), compute=compute)
        assert target.compute.path == compute
        got = logits_of(target)
        # a random tiny model amplifies its linears' errors unevenly: qwen3 Q4_K_M measured 0.163 on the q4 path (0.148
        # before its Q6_K matrices went 8-bit blocks, each of them closer than before: the test below) and 0.076 int8
        assert relative_rms(got, want) <= 0.2, compute
        assert agrees_where_decisive(got, want), compute
        ids = target.encode_chat("Tell me about the sea, the sea, the sea.")
        ar = generate_ar(target, ids, 48, stop_token_ids=()).tokens
        spec = generate("lookup", target, ids, 48, stop_token_ids=())
        assert spec.tokens == ar, compute


@pytest.mark.parametrize("weight_type", ["Q4_K_M", "Q6_K", "Q8_0", "Q5_0", "F16"])
def test_8bit_blocks_are_closer_per_linear_than_int8_rows(gguf_dir, weight_type):
    """Each matrix the q4 path runs as 8-bit blocks (activations per 32, as llama.cpp) is closer to the file's
    function than int8 rows (activations per row) on the same inputs."""
    from drafttree.model.gguf_model import build_gguf_model
    from drafttree.model.linear import Int8Linear, Q8Linear

    path = tiny_file(gguf_dir, "qwen3", weight_type)
    q4, _ = build_gguf_model(path, "q4", "avx2", quiet=True)
    exact, _ = build_gguf_model(path, "fp32", quiet=True)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(0)) * 3
    blocks = [(name, m) for name, m in q4.named_modules() if isinstance(m, Q8Linear)]
    assert blocks
    for name, layer in blocks:
        ref = exact.get_submodule(name)
        xx = x[:, : ref.in_features]
        want = ref(xx)
        rows = Int8Linear(ref.weight.float(), None, "avx2")(xx)
        assert relative_rms(layer(xx), want) < relative_rms(rows, want), name


@pytest.mark.parametrize("weight_type", ["Q4_K_M", "Q6_K", "BF16"])
def test_int8_path_equals_the_int8_path_of_the_dequantized_checkpoint(gguf_dir, tmp_path, weight_type):
    """Converted row chunk by row chunk from the file, or quantized from a fp32 checkpoint of the same dequantized
    weights by the loader of Hugging Face directories: the same int8 rows, the same logits (llama: tied, so the
    embedding is int8 rows on both)."""
    from drafttree.load import load_target

    path = tiny_file(gguf_dir, "llama", weight_type)
    dequantized_reference(path, "llama").save_pretrained(tmp_path)
    # a GGUF file's int8 path is not smoothed (model/smoothing.py): the conversions are compared unsmoothed
    from_dir = load_target(str(tmp_path), compute="int8", int8_smoothing=False)
    from_file = load_target(str(path), compute="int8")
    assert torch.equal(logits_of(from_file), logits_of(from_dir))


@pytest.mark.parametrize("compute", ["fp32", "q4", "int8"])
def test_conversion_in_small_row_chunks_changes_nothing(gguf_dir, compute, monkeypatch):
    """Real models are converted a few rows at a time (CHUNK_WEIGHTS); the tiny ones fit in one chunk, so here
    chunks of 3-4 rows (llama: q/k rows reordered across chunk boundaries) must give the same model."""
    import drafttree.model.gguf_model as gm
    from drafttree.load import load_target

    path = str(tiny_file(gguf_dir, "llama", "Q4_K_M"))
    whole = logits_of(load_target(path, compute=compute))
    monkeypatch.setattr(gm, "CHUNK_WEIGHTS", 1000)
    assert torch.equal(logits_of(load_target(path, compute=compute)), whole)


def test_bf16_path(gguf_dir):
    from drafttree.load import load_target

    path = tiny_file(gguf_dir, "qwen3", "Q6_K")
    target = load_target(str(path), compute="bf16")
    assert target.model.dtype == torch.bfloat16
    assert relative_rms(logits_of(target), reference_logits(path, "qwen3")) <= 0.05


def test_tokenizer_and_chat_template_come_from_the_metadata(gguf_dir):
    from drafttree.load import load_target

    target = load_target(str(tiny_file(gguf_dir, "qwen3", "Q8_0")), compute="fp32")
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert target.stop_token_ids == (2,)  # tokenizer.ggml.eos_token_id: <|im_end|>
    assert target.decode(target.encode("hello world")) == "hello world"


def test_load_reports_the_conversion(gguf_dir, capsys):
    from drafttree.load import load_target

    load_target(str(tiny_file(gguf_dir, "llama", "Q4_K_M")), compute="q4")
    err = capsys.readouterr().err
    assert "native K-quant kernels: a later slice" in err
    assert any("attn_output" in line and "Q4_K" in line and "-> Q4_1" in line and "relative RMS" in line
               for line in err.splitlines())
    assert any("ffn_down" in line and "Q6_K" in line and "-> 8-bit blocks" in line for line in err.splitlines())


# ---- the commands ---------------------------------------------------------------------------------------------

def test_generate_command_lookup_equals_ar(gguf_dir, capsys):
    path = str(tiny_file(gguf_dir, "llama", "Q4_K_M"))
    outputs = []
    for method in ("ar", "lookup"):
        assert main(["generate", "Tell me a story about a story.", "--model", path, "--method", method,
                     "--max-new-tokens", "32", "--threads", "1"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_bench_command_runs_a_gguf(gguf_dir, tmp_path, capsys):
    path = str(tiny_file(gguf_dir, "qwen3", "Q4_0"))
    assert main(["bench", "--model", path, "--methods", "ar,lookup", "--datasets", "gsm8k", "--limit", "1",
                 "--max-new-tokens", "16", "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mismatches vs AR: lookup: 0/1" in out


# ---- bad input: one line naming the problem and what to do ---------------------------------------------------

def one_line_error(capsys, path):
    assert main(["generate", "hi", "--model", str(path), "--max-new-tokens", "4", "--compute", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_file_that_is_not_gguf(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_text("not a model")
    assert "is not a GGUF file" in one_line_error(capsys, path)


def test_unknown_architecture(tmp_path, capsys):
    err = one_line_error(capsys, write_tiny_gguf(tmp_path / "g.gguf", "gemma2", "Q8_0", tokenizer=False))
    assert "'gemma2' is not supported" in err and "llama, qwen2, qwen3" in err


def test_unsupported_type(tmp_path, capsys):
    err = one_line_error(capsys, write_tiny_gguf(tmp_path / "q.gguf", "llama", "Q8_0", types={"ffn_up": "Q2_K"},
                                                 tokenizer=False))
    assert "ffn_up.weight is Q2_K" in err and "llama-quantize" in err


def test_missing_metadata(tmp_path, capsys):
    err = one_line_error(capsys, write_tiny_gguf(tmp_path / "m.gguf", "qwen3", "Q8_0", tokenizer=False,
                                                 drop_keys=("qwen3.block_count",)))
    assert "lacks 'qwen3.block_count'" in err and "convert_hf_to_gguf.py" in err


def test_rope_scaling_is_refused(tmp_path, capsys):
    err = one_line_error(capsys, write_tiny_gguf(tmp_path / "r.gguf", "llama", "Q8_0", tokenizer=False,
                                                 extra_keys={"llama.rope.scaling.type": "yarn"}))
    assert "RoPE scaling (yarn) is not supported" in err


def test_no_tokenizer_means_token_ids_only(tmp_path):
    from drafttree.load import load_target

    target = load_target(str(write_tiny_gguf(tmp_path / "n.gguf", "qwen3", "Q8_0", tokenizer=False)), compute="fp32")
    assert target.tokenizer is None
    with pytest.raises(ValueError, match="without tokenizer"):
        target.encode("hi")


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["q4", "int8"])
def test_the_embedded_file_as_a_path_equals_the_embedded_model(compute):
    """SmolLM2's own GGUF given as a path: the same logits, bit for bit, as the embedded loader (which converts
    through safetensors): the same Q4_1 blocks, the same int8 rows."""
    import os

    from drafttree.gguf_convert import find_embedded_gguf
    from drafttree.load import load_target

    threads = os.cpu_count()
    by_path = load_target(str(find_embedded_gguf("smollm2-135m-instruct")), compute=compute, threads=threads)
    # a GGUF file's int8 path is not smoothed (model/smoothing.py): the conversions are compared unsmoothed
    embedded = load_target("smollm2-135m-instruct", compute=compute, threads=threads, int8_smoothing=False)
    ids = embedded.encode_chat("Write a haiku about the sea.")
    assert torch.equal(by_path.encode_chat("Write a haiku about the sea."), ids)
    assert torch.equal(logits_of(by_path, ids), logits_of(embedded, ids))
