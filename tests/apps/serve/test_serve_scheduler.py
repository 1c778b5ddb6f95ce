"""The scheduler on a fake decoder: round-robin turns, FIFO admission under max_concurrency, cancel and
failure drop the job and close its Sequence, the others go on."""
import threading
import time

import torch

from drafttree.sampling import SamplingParams
from drafttree.apps.serve.scheduler import Job, QueueFull, Scheduler
from drafttree.apps.serve.text import OutputText
from conftest import CharTokenizer, FakeDecoder

import pytest


class Sink:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event["type"] in ("done", "error"):
            self.done.set()

    @property
    def text(self):
        return "".join(e["text"] for e in self.events if e["type"] == "text")

    @property
    def last(self):
        return self.events[-1]


def job(method, last_token, max_new, stops=()):
    sink = Sink()
    j = Job(method, torch.tensor([5, last_token]), max_new, SamplingParams(), OutputText(CharTokenizer(), stops), sink)
    return j, sink


def wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_round_robin_and_fifo_admission():
    dec = FakeDecoder()
    sched = Scheduler(dec, max_concurrency=2)
    jobs = [job("ar", 10 * i, 3) for i in range(4)]  # ar:0 .. ar:30, each 3 steps
    for j, _ in jobs:
        sched.submit(j)  # queued before the worker starts: they wait
    assert (sched.health()["waiting"], sched.health()["active"]) == (4, 0)
    sched.start()
    try:
        for _, sink in jobs:
            assert sink.done.wait(10)
    finally:
        sched.stop()
    # two at a time, one step each per turn, in admission order; the waiting two follow in FIFO order
    assert dec.log == ["ar:0", "ar:10"] * 3 + ["ar:20", "ar:30"] * 3
    for i, (_, sink) in enumerate(jobs):
        want = CharTokenizer().decode([(10 * i + k + 1) % 200 for k in range(3)])
        assert sink.text == want and sink.last["finish_reason"] == "length" and sink.last["completion_tokens"] == 3
    assert all(s.closed for s in dec.made)
    h = sched.health()
    assert (h["active"], h["waiting"], h["state_bytes"], h["finished"]) == (0, 0, 0, 4)


def test_cancel_waiting_and_active_jobs():
    dec = FakeDecoder(delay=0.001)
    sched = Scheduler(dec, max_concurrency=2)
    (a, sa), (b, sb), (c, sc) = job("ar", 1, 10 ** 6), job("ar", 2, 10 ** 6), job("ar", 3, 5)
    for j in (a, b, c):
        sched.submit(j)
    sched.cancel(c)  # waiting: leaves the queue at once
    assert sched.health()["waiting"] == 2
    sched.start()
    try:
        wait(lambda: len(dec.made) == 2 and dec.made[1].steps > 3)
        assert sched.health()["state_bytes"] > 0
        sched.cancel(b)  # active: dropped at its next turn, a goes on
        wait(lambda: dec.made[1].closed)
        steps = dec.made[0].steps
        wait(lambda: dec.made[0].steps > steps + 3)
        sched.cancel(a)
        wait(lambda: sched.health()["active"] == 0)
        assert all(s.closed for s in dec.made) and sched.health()["state_bytes"] == 0
        assert sched.health()["cancelled"] == 3 and len(dec.made) == 2  # c never got a Sequence
        for sink in (sa, sb, sc):  # a cancelled job's client is gone: no done or error event for it
            assert all(e["type"] == "text" for e in sink.events)
    finally:
        sched.stop()


def test_failure_reaches_its_request_only():
    dec = FakeDecoder()
    dec.fail_methods["chain"] = 3
    sched = Scheduler(dec, max_concurrency=4)
    sched.start()
    try:
        (bad, sbad), (ok, sok), (broken, sbroken) = job("chain", 1, 8), job("ar", 50, 8), job("broken", 7, 8)
        for j in (bad, ok, broken):
            sched.submit(j)
        for s in (sbad, sok, sbroken):
            assert s.done.wait(10)
        assert sbad.last["type"] == "error" and "injected fault" in sbad.last["message"]
        assert sbroken.last["type"] == "error" and "cannot make this sequence" in sbroken.last["message"]
        assert sok.last["type"] == "done" and sok.text == CharTokenizer().decode(range(51, 59))
        assert all(s.closed for s in dec.made)
        assert sched.health()["failed"] == 2 and sched.health()["worker_alive"]
        (again, sagain) = job("ar", 50, 8)  # the worker still serves, and the same way
        sched.submit(again)
        assert sagain.done.wait(10) and sagain.text == sok.text
    finally:
        sched.stop()


def test_stop_string_ends_the_sequence_early():
    dec = FakeDecoder()
    sched = Scheduler(dec)
    sched.start()
    try:
        tok = CharTokenizer()
        want = tok.decode(range(21, 41))
        j, sink = job("ar", 20, 100, stops=(want[5:8],))
        sched.submit(j)
        assert sink.done.wait(10)
        assert sink.text == want[:5] and sink.last["finish_reason"] == "stop" and sink.last["completion_tokens"] == 8
        assert dec.made[0].closed and dec.made[0].steps == 8  # no step after the stop string
    finally:
        sched.stop()


def test_queue_bound_and_shutdown():
    dec = FakeDecoder(delay=0.01)
    sched = Scheduler(dec, max_concurrency=1, max_waiting=2)
    sched.start()
    jobs = [job("ar", i, 1_000) for i in range(3)]
    sched.submit(jobs[0][0])
    wait(lambda: sched.health()["active"] == 1)
    for j, _ in jobs[1:]:
        sched.submit(j)
    with pytest.raises(QueueFull):
        for _ in range(3):
            sched.submit(job("ar", 9, 3)[0])
    sched.stop()
    for _, sink in jobs:  # every client hears that the server went away
        assert sink.done.is_set() and sink.last["type"] == "error"
    assert all(s.closed for s in dec.made)
    with pytest.raises(QueueFull):
        sched.submit(job("ar", 1, 3)[0])
