"""The one thread a service runs its model on, from loading to the last step.

NOTE: each thread that runs a parallel torch op gets its own OpenMP team, and once a process holds more OpenMP
threads than cores, libgomp stops spin-waiting between parallel regions (its throttled spin count). A service that
loaded its model on the main thread and stepped it on a worker thread paid for that on every step: measured on the
2-core machine, the 0.5B int4 draft's verifier step took 24.9 ms loaded on the main thread and 17.5 ms loaded on the
stepping thread, and 25.4 ms again after one matmul on the main thread. So both services load the model on the
thread that will step it, and keep parallel torch work off every other thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def compute_thread(name: str) -> ThreadPoolExecutor:
    """A single-thread executor: load the model on it, then run every step on it."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
