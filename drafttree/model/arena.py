"""A model's weights moved into one arena backed by 2 MB pages.

A decode step streams every weight once (SmolLM2-135M q4: 66 MB in ~120 tensors of 0.1-0.9 MB each). Allocated one
by one, those tensors sit on 4 KB pages: ~17,000 page translations a step, each a two-level walk inside a VM. One
arena advised as huge pages (`madvise(MADV_HUGEPAGE)`; Linux's default THP mode, "madvise", honours it) needs ~35.
Measured on a 2-vCPU Emerald Rapids VM (AVX-512 VNNI, q4, 2 threads), the two placements alternating in one process:
a verify of 1 / 4 / 8 tokens at context 200 in 0.93 / 0.91-0.95 / 0.91-0.93× the time; decoding
(bench/lockstep_ab.py, 6 prompts × 128 tokens) AR 1.04×, caddtree 1.10× the tok/s.

The bits do not change: every tensor keeps its values, shape and strides, and tensors that shared a storage still
share one (`Tensor.set_` in place, so every module, parameter and alias holding the tensor object sees the move).
Storage by storage, each old one freed as its last view moves and the C heap's free pages handed back every 64 MB,
so loading peaks no higher than without the move (Qwen3-1.7B-shaped Q4_K_M file: 2,700 MiB either way; 3,741 before
the hand-back). Elsewhere than Linux, or with DRAFTTREE_HUGE_PAGES=0, nothing moves.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch
import torch.nn as nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every storage starts on a cache line (the kernels' vector loads do not need it; it is free)
_RELEASE_EVERY = 64 << 20  # bytes moved between two returns of freed memory: the move's extra resident memory
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("DRAFTTREE_HUGE_PAGES", "1") != "0"


def huge_pages_status(setting: str = THP_SETTING) -> str:
    """One line for `drafttree info`: whether the weights go on 2 MB pages here, and how to change it."""
    if sys.platform != "linux":
        return "weights on 2 MB pages: no (Linux only)"
    if not huge_pages_enabled():
        return "weights on 2 MB pages: off (DRAFTTREE_HUGE_PAGES=0)"
    try:
        mode = next(w[1:-1] for w in open(setting).read().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "weights on 2 MB pages: asked for (this system does not say whether it grants them)"
    if mode == "never":
        return (f"weights on 2 MB pages: asked for, but this system's transparent huge pages are off ({setting}: "
                "never; `madvise` there turns them on: decoding measured 4-10 % faster with them)")
    return f"weights on 2 MB pages: yes (transparent huge pages: {mode})"


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on fresh anonymous pages advised as huge pages, starting on a 2 MB boundary. Fresh: memory
    from the C heap may already be touched on 4 KB pages (a loaded model frees plenty of it), and advice comes
    too late for those."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory has no THP
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as any view of it
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, size)  # before the first touch
    return whole[start:start + nbytes]


def _release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc keeps freed chunks below its mmap threshold, which a
    model's loading raises to 32 MB: without this, moving a 1.7B model's weights held both copies resident)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pack_weights(model: nn.Module) -> torch.Tensor | None:
    """Move every CPU parameter and buffer of `model` into one 2 MB-aligned arena advised as huge pages; returns
    the arena (the tensors are views of it), or None where nothing moved (disabled, or no tensors)."""
    if not huge_pages_enabled():
        return None
    by_storage: dict[int, list[torch.Tensor]] = {}  # storage address -> the tensors viewing it
    for t in (*model.parameters(), *model.buffers()):  # each tensor once, however many modules share it
        if t.device.type == "cpu":
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = [-(-views[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN for views in by_storage.values()]
    if not sum(sizes):
        return None
    buffer = _huge_page_buffer(sum(sizes))
    arena, start = buffer.untyped_storage(), buffer.storage_offset()  # bytes from the storage's start
    at = released = 0
    with torch.no_grad():
        for views, size in zip(by_storage.values(), sizes):
            old = views[0].untyped_storage()
            if old.nbytes():
                buffer[at:at + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            del old
            for t in views:  # the old storage goes as soon as its last view moves: the copy adds one storage at most
                t.set_(arena, (start + at) // t.element_size() + t.storage_offset(), t.size(), t.stride())
            at += size
            if at - released >= _RELEASE_EVERY:
                _release_freed_memory()
                released = at
    _release_freed_memory()
    return buffer
