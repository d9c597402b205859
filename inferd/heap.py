"""The Python heap a process built while starting, kept out of the garbage collector's way.

    freeze_startup_heap("api")   # once, after start-up, before the first request

Start-up leaves a few hundred thousand long-lived objects (torch, FastAPI and pydantic schemas, the
model's modules): ~225k tracked in the API process, ~185k in the engine core. CPython's full
(generation 2) collection walks all of them, and serving triggers one every so often: measured
here (2 cores, llama-32m), 98-105 ms with the API process's event loop stopped, 76-92 ms with the
engine core between two steps. The first burst of requests after start-up met one in the API
process every time: 96 requests sent at once reached the handlers 119-147 ms after the client sent
them instead of 31-38 ms, and the burst's median time to first token was 1.18-1.34 s instead of
0.99-1.00 s (docs/benchmarks.md). `gc.freeze()` moves every object alive now into a permanent
generation that collections skip (what it is for, per the gc docs; vLLM's engine does the same);
objects created while serving are collected as before.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("inferd")


def freeze_startup_heap(process: str) -> None:
    """Collects once, then freezes what is left. `process` names it in the log."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        process,
        gc.get_freeze_count(),
        (time.perf_counter() - t0) * 1e3,
    )
