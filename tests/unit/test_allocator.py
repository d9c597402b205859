"""`keep_freed_memory`: a CPU engine's freed activations stay mapped for the next step."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from inferd.executor.device import keep_freed_memory

pytestmark = pytest.mark.unit


def _faults_of_steps(nbytes: int, steps: int) -> int:
    """Minor page faults of `steps` "steps" that each hold two `nbytes` blocks at once (an
    activation and the next layer's output), touch them and free them."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(1)
        b.fill_(1)
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_freed_activations_are_not_faulted_back_in() -> None:
    assert keep_freed_memory(torch.device("cpu"))
    # Without the change glibc's adaptive trim threshold (twice the largest block freed) is below
    # the two blocks freed together, so each step gives them back and faults them in again:
    # 12,288 faults (4 KiB pages) per step of two 24 MiB blocks, 61,280 over 5 steps, measured.
    # With it none once the heap has grown to hold them; in a busy process (pytest) that took up
    # to 2 steps' worth more after the warm-up, so the bound is a quarter of the 10 steps'.
    nbytes = 24 << 20
    per_step = 2 * nbytes // 4096
    _faults_of_steps(nbytes, 3)
    assert _faults_of_steps(nbytes, 10) < 10 * per_step // 4


def test_other_devices_are_left_alone() -> None:
    assert not keep_freed_memory(torch.device("cuda"))
