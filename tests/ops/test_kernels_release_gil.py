"""The C++ kernels run without the GIL: another Python thread (in `drafttree serve`, the HTTP loop writing the last
round's text) runs while one of them computes, instead of waiting for it to end."""
import threading
import time

import torch

from drafttree.ops.cpu_extension import ISA_CODES, extension


def test_another_thread_runs_during_a_kernel_call():
    x, w = torch.randn(4096, 8192), torch.ones(8192)  # scalar RMSNorm over 32M floats: tens of ms at least
    ticks: list[float] = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=count, daemon=True)
    t.start()
    try:
        time.sleep(0.05)  # the counting thread is running and waits for the GIL
        for _ in range(5):  # a few tries: on a loaded machine the thread may not get a core at once
            t0 = time.perf_counter()
            extension().rms_norm(x, w, 1e-6, ISA_CODES["scalar"])
            t1 = time.perf_counter()
            # Holding the GIL, the call would let the thread run only after it returned (a forced switch comes at
            # the next bytecode); ticks in its first half can only come from the call running without it.
            if any(t0 < s < t0 + (t1 - t0) / 2 for s in ticks):
                return
    finally:
        stop.set()
        t.join()
    raise AssertionError("no Python thread ran while the kernel computed: does it still hold the GIL?")
