"""freeze_startup_heap: what is alive at start-up leaves the collector's generations."""

from __future__ import annotations

import gc
import logging

import pytest

from inferd.heap import freeze_startup_heap

pytestmark = pytest.mark.unit


def test_startup_objects_are_frozen_and_later_ones_collected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    startup = [[i] for i in range(1000)]  # lists: objects the collector tracks
    try:
        with caplog.at_level(logging.INFO, logger="inferd"):
            freeze_startup_heap("test")
        assert gc.get_freeze_count() >= len(startup)
        in_generations = {id(o) for g in range(3) for o in gc.get_objects(g)}
        assert not any(id(o) in in_generations for o in startup), "a collection would walk them"
        later = [1]
        assert id(later) in {id(o) for o in gc.get_objects(0)}, (
            "new objects are collected as before"
        )
        assert "test: " in caplog.text and "frozen" in caplog.text
    finally:
        gc.unfreeze()
