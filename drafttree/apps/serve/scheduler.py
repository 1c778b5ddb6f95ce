"""One worker thread runs every request's decode, interleaving their rounds fairly.

torch on a small CPU is fastest with all model work on one thread (its intra-op threads use the cores),
and drafttree's Sequences may be stepped in any order but only from one thread at a time. So every
request becomes a `Job`; the worker keeps up to `max_concurrency` of them active and, turn after turn,
gives each active job one round (round-robin: `engine.step_many`, which verifies all their draft trees in
one batched forward where the model allows); the rest wait in FIFO order. After each step the job's new tokens become text (OutputText:
complete characters, cut at stop strings) and go to the request through `deliver`, which the app makes
thread-safe with `loop.call_soon_threadsafe`.

A job ends when its Sequence is done, a stop string is found, its client is gone (`cancel`), or its step
raises; in every case the worker drops it and calls `Sequence.close()`, which frees its state. A failure
is reported to that request alone: the Sequences share only the read-only model weights, the drafter and
the cost model.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ...engine import Sequence, step_many
from ...sampling import SamplingParams
from .text import OutputText


class Decoder(Protocol):
    """What the worker needs to start a request (drafttree.methods.Decoder)."""

    def sequence(self, method: str, prompt_ids: torch.Tensor, max_new_tokens: int = ...,
                 sampling: SamplingParams = ...) -> Sequence: ...


class QueueFull(Exception):
    """More requests wait than the server accepts."""


class ShuttingDown(QueueFull):
    """The scheduler is stopping: no new requests."""


@dataclass(eq=False)
class Job:
    method: str
    prompt_ids: torch.Tensor
    max_new_tokens: int
    sampling: SamplingParams
    output: OutputText
    deliver: Callable[[dict], None]  # called on the worker thread; must be thread-safe and quick
    # filled in by the scheduler
    seq: Sequence | None = None
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # admitted: its first step (the prefill) begins
    first_token: float | None = None

    def timing(self) -> dict:
        end = time.perf_counter()
        return {"queue_s": round((self.started or end) - self.submitted, 4),
                "time_to_first_token_s": None if self.first_token is None else round(self.first_token - self.submitted, 4),
                "wall_s": round(end - self.submitted, 4)}


class Scheduler:
    def __init__(self, decoder: Decoder, max_concurrency: int = 8, max_waiting: int = 1024, worker_thread: bool = True):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.decoder = decoder
        self.max_concurrency, self.max_waiting = max_concurrency, max_waiting
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []  # touched by the worker only; its length is read under the lock
        self._state_bytes = 0  # of the active Sequences, refreshed by the worker after every turn
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.worker_thread = worker_thread  # False: the caller runs the worker (run_here) and start() spawns none
        self._working = False  # the worker loop is running (its own thread or run_here's)
        self.counts: collections.Counter[str] = collections.Counter()  # finished, cancelled, failed, tokens

    # ---- called from the app (any thread) --------------------------------------------------------

    def start(self) -> None:
        """The worker in a thread of its own (tests, an app served by someone else's loop); `drafttree serve` runs it
        on the main thread instead (`run_here`)."""
        if self._thread is None and self.worker_thread:
            self._stopping, self._working = False, True  # alive from now: a health check may come first
            self._thread = threading.Thread(target=self._run, name="drafttree-scheduler", daemon=True)
            self._thread.start()

    def run_here(self) -> None:
        """The worker on the calling thread until `stop()`. On the thread that loaded the model its rounds run at full
        speed; on a second thread every parallel region paid ≈ 0.1 ms (2-vCPU Zen 4: a one-token q4 matmul 21 -> 132
        µs; one AR request through the server 50 tok/s, 125-144 with this). The likely cause: a second OpenMP pool
        takes the pool threads past the cores, and libgomp then stops spinning between regions (OMP_WAIT_POLICY=
        PASSIVE makes the main thread as slow; a larger GOMP_SPINCOUNT speeds the second thread up)."""
        if self.worker_thread:
            raise RuntimeError("this scheduler starts a worker thread of its own: make it with worker_thread=False "
                               "to run the worker here")
        self._run()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in progress, then drop and close every job (their clients get an error)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue now, an active one at the worker's next turn."""
        if job.finished:
            return
        with self._cv:
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.finished = True
                self.counts["cancelled"] += 1
            self._cv.notify_all()

    def health(self) -> dict:
        with self._cv:
            return {"active": len(self._active), "waiting": len(self._waiting), "state_bytes": self._state_bytes,
                    "max_concurrency": self.max_concurrency, "worker_alive": self._working,
                    **{k: self.counts[k] for k in ("finished", "cancelled", "failed")}}

    # ---- the worker ------------------------------------------------------------------------------

    def _run(self) -> None:
        self._working = True
        try:
            with torch.no_grad():  # grad mode is per thread: the model runs here, not where it was loaded
                while True:
                    with self._cv:
                        while not self._stopping and not self._waiting and not self._active:
                            self._cv.wait()
                        if self._stopping:
                            break
                        while self._waiting and len(self._active) < self.max_concurrency:
                            self._active.append(self._waiting.popleft())
                        turn = list(self._active)
                    self._turn(turn)
                    self._refresh()
        finally:  # stopped, or interrupted (Ctrl-C on the main thread): every job still here gets its answer
            with self._cv:
                self._stopping, self._working = True, False
                jobs, self._active = self._active + list(self._waiting), []
                self._waiting.clear()
            for job in jobs:
                self._end(job, error="the server is shutting down")
            self._refresh()

    def _refresh(self) -> None:
        total = 0
        for job in self._active:
            if job.seq is not None:
                try:
                    total += int(job.seq.state_bytes)
                except Exception:  # a broken Sequence is dropped at its next step
                    pass
        with self._cv:
            self._state_bytes = total

    def _turn(self, jobs: list[Job]) -> None:
        """One round of every active job; their verify forwards run as one batched forward (step_many)."""
        ready: list[tuple[Job, Sequence]] = []
        for job in jobs:
            if job.cancelled:
                self._end(job, cancelled=True)
                continue
            try:
                if job.seq is None:
                    job.started = time.perf_counter()
                    job.seq = self.decoder.sequence(job.method, job.prompt_ids, max_new_tokens=job.max_new_tokens,
                                                    sampling=job.sampling)
            except Exception as e:  # this request fails; the others go on
                self._failed(job, e)
                continue
            ready.append((job, job.seq))
        if ready:
            for (job, seq), new in zip(ready, step_many([seq for _, seq in ready])):
                self._after_step(job, seq, new)

    def _failed(self, job: Job, e: BaseException) -> None:
        trace = "".join(traceback.format_exception(e))
        print(f"drafttree serve: a {job.method} decode failed:\n{trace}", file=sys.stderr)
        self._end(job, error=f"the decode failed ({type(e).__name__}: {e})")

    def _after_step(self, job: Job, seq: Sequence, new: list[int] | Exception) -> None:
        if isinstance(new, Exception):
            self._failed(job, new)
            return
        try:
            text = job.output.push(new)
            reason = "stop" if job.output.stopped else None
            if reason is None and seq.done:
                text += job.output.finish()
                reason = "stop" if job.output.stopped else seq.finish_reason or "length"
        except Exception as e:
            self._failed(job, e)
            return
        if new and job.first_token is None:
            job.first_token = time.perf_counter()
        if text:
            self._deliver(job, {"type": "text", "text": text})
        if reason is not None:
            self._end(job, reason=reason)

    def _deliver(self, job: Job, event: dict) -> None:
        try:
            job.deliver(event)
        except Exception:  # e.g. the event loop is closed: nobody listens any more
            job.cancelled = True

    def _end(self, job: Job, reason: str | None = None, error: str | None = None, cancelled: bool = False) -> None:
        stats = None
        if job.seq is not None:
            try:
                stats = job.seq.stats.summary()
            except Exception:
                stats = None
            try:
                job.seq.close()
            except Exception:
                print(f"drafttree serve: close() failed:\n{traceback.format_exc()}", file=sys.stderr)
            job.seq = None
        with self._cv:
            if job in self._active:
                self._active.remove(job)
            job.finished = True
            self.counts["cancelled" if cancelled else "failed" if error else "finished"] += 1
        if cancelled:
            return
        if error is not None:
            self._deliver(job, {"type": "error", "message": error})
        else:
            self.counts["tokens"] += job.output.tokens
            self._deliver(job, {"type": "done", "finish_reason": reason, "completion_tokens": job.output.tokens,
                                "stats": stats, "timing": job.timing()})
