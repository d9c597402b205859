"""Test tiers by folder, as LitServe marks them: every test under tests/unit is `unit`, under
tests/integration `integration`, under tests/e2e `e2e`, so `pytest -m unit` finds all of them
without a marker line in each file (a file may still add its own, e.g. a timeout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from inferd.config import read_environment
from inferd.models import kernels
from inferd.models.kernels import NativeKernels

_TIERS = ("unit", "integration", "e2e")

# No per-example deadline anywhere: Hypothesis's default 200 ms fails a pure test on a 2-core box
# busy with other work, which proves nothing about the code. A test's own @settings inherit this.
settings.register_profile("inferd", deadline=None)
settings.load_profile("inferd")
_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).relative_to(_ROOT).parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def native_kernels() -> NativeKernels:
    """The native CPU kernel library (built on first use), or the test is skipped saying why."""
    try:
        return kernels.load(read_environment().cache_dir)
    except kernels.KernelUnavailable as e:
        pytest.skip(f"native kernels unavailable here: {e}")


@pytest.fixture(params=["amx", "avx512"])
def panel_path(request: pytest.FixtureRequest, native_kernels: NativeKernels) -> Iterator[str]:
    """Runs the test with the panel GEMM and the greedy screen on AMX tiles, then on the AVX-512
    loop (kernels/amx.h); `amx` is skipped where the CPU has no AMX."""
    with native_kernels.gemv.amx_set(request.param == "amx") as on:
        if request.param == "amx" and not on:
            pytest.skip("no AMX on this CPU (or the kernel was not granted the tiles)")
        yield request.param
