import os

# Tiny models run fastest on one thread (and do not fight other processes for cores); the real-model
# tests below switch to every core.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from drafttree.datasets import load_prompts
from drafttree.engine import generate_ar

from sampling_helpers import VOCAB
from tiny_models import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def _threads(request):
    real = any(name in request.fixturenames for name in ("smollm2", "ar_outputs"))
    torch.set_num_threads(os.cpu_count() if real else int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", params=["llama", "llama_untied_bias", "qwen3"])
def tiny_checkpoint(request, tmp_path_factory):
    """(directory, transformers model) of a tiny random-weight model, saved as safetensors."""
    path = tmp_path_factory.mktemp(request.param)
    return path, make_tiny_checkpoint(request.param, path)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model in fp32, with transformers' model on the same weights as a reference."""
    from transformers import AutoModelForCausalLM

    from drafttree.gguf_convert import convert_embedded
    from drafttree.load import load_target

    target = load_target("smollm2-135m-instruct", dtype="float32", threads=os.cpu_count())
    ref = AutoModelForCausalLM.from_pretrained(str(convert_embedded("smollm2-135m-instruct")), dtype=torch.float32).eval()
    return target, ref


def real_prompts(n: int) -> list[str]:
    per = (n + 2) // 3
    return (load_prompts("gsm8k", per) + load_prompts("humaneval", per) + load_prompts("mtbench", per))[:n]


@pytest.fixture(scope="session")
def ar_outputs(smollm2):
    """AR greedy replies (64 tokens, stop tokens ignored) to 20 real prompts, shared by the tests below."""
    target, _ = smollm2
    return [(target.encode_chat(t), generate_ar(target, target.encode_chat(t), 64, stop_token_ids=()).tokens)
            for t in real_prompts(20)]


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    """A transformers Llama with a vocabulary small enough to enumerate joint distributions (sampling_helpers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.25)
    path = tmp_path_factory.mktemp("small_vocab")
    hf.eval().save_pretrained(path)
    return path, hf
