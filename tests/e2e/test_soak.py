"""The soak's CI version: bench/soak.py for 60 s against a real server, with the full run's checks
(every request accounted for, no unexpected status, nothing leaked, memory and descriptors back)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

DURATION_S = 60.0
CLIENTS = 6  # enough to keep batches and queues busy on 2 cores without starving the server


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_soak(tmp_path: Path) -> None:
    soak = load_soak()
    report = soak.soak(soak.LoadSpec(DURATION_S, CLIENTS, seed=1), tmp_path)
    summary = report.summary()
    assert report.check() == [], summary
    # Not vacuous: every scenario ran and ended the way it exists to end.
    counts = report.tally.counts
    for name in soak.SCENARIOS:
        assert sum(n for (s, _), n in counts.items() if s == name) > 0, (name, summary)
    assert counts[("stream_disconnect", "cancelled")] > 0
    assert counts[("websocket_cancel", "cancelled")] > 0
    assert counts[("malformed", "rejected")] > 0
    assert counts[("repository_unload", "answered")] == 1
    assert counts[("repository_load", "answered")] == 1
    assert report.llm_client > 100 and report.classic_client > 100, summary
