"""The dynamic batcher's time source: `now()` and timers at instants of the same clock.

    clock = MONOTONIC                   # time.monotonic() + the running loop's timers
    timer = clock.call_at(clock.now() + 0.002, wake)

Injectable so that tests drive the batcher with a fake clock they advance by hand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """A pending wake-up: asyncio.Handle or TimerHandle (a loop may answer a call_at
    less than half a millisecond ahead with a plain Handle, as uvloop does)."""

    def cancel(self) -> None: ...

    def cancelled(self) -> bool: ...


class Clock(Protocol):
    """The batcher's only source of time: `now()` in seconds, and a callback at an instant
    of that clock. Called on the event loop only."""

    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer: ...


class MonotonicClock:
    """time.monotonic() and the running loop's timers (asyncio's loop clock is monotonic too,
    so a gateway's `time.monotonic()` deadline and a loop timer agree)."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)


MONOTONIC = MonotonicClock()
