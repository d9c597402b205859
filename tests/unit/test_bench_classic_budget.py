"""bench/classic_budget.py's pure parts: each thread's CPU time read from /proc, and the split of
a server's threads into the event loop, the model's threads and the rest."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from classic_budget import split, thread_cpu


def test_split_takes_the_main_thread_then_the_busiest_others_for_the_model() -> None:
    used = {100: 0.5, 101: 3.0, 102: 0.2, 103: 2.0, 104: 0.1}
    groups = split(100, used, model_threads=2)
    assert groups == {"event_loop": 0.5, "model": 5.0, "other": pytest.approx(0.3)}
    assert split(100, used, model_threads=1)["model"] == 3.0
    assert split(100, used, model_threads=0) == {"event_loop": 0.5, "other": pytest.approx(5.3)}


def test_thread_cpu_lists_every_thread_of_a_process() -> None:
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        stop.wait(10)

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        assert started.wait(10)
        cpu = thread_cpu(os.getpid())
        assert os.getpid() in cpu and worker.native_id in cpu
        assert all(seconds >= 0.0 for seconds in cpu.values())
    finally:
        stop.set()
        worker.join()
