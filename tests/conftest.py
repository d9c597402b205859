"""Test tiers by folder, as LitServe marks them: every test under tests/unit is `unit`, under
tests/integration `integration`, under tests/e2e `e2e`, so `pytest -m unit` finds all of them
without a marker line in each file (a file may still add its own, e.g. a timeout).

The run ends with its skips (and expected failures) counted by reason, also written, with
pytest's exit status, to the file `--skip-summary PATH` names (.ci/run prints it last): a missing
tool or CPU feature shows as one line with its count, not as hundreds of `-ra` lines."""

from __future__ import annotations

from collections import Counter
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


_skips: Counter[str] = Counter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-summary",
        metavar="PATH",
        help="also write the skips counted by reason to PATH (.ci/run prints it at the end)",
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skips[_skip_reason(report)] += 1


def _skip_reason(report: pytest.TestReport) -> str:
    """`xfail: why` for an expected failure, else the skip's reason (a skip mark's own words, or
    pytest.skip's message without its "Skipped: " prefix)."""
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    lines = [f"{count:6d}  {reason}" for reason, count in _skips.most_common()]
    if lines:
        terminalreporter.write_sep("=", "skipped or xfailed, by reason")
        for line in lines:
            terminalreporter.write_line(line)
    path = config.getoption("--skip-summary")
    if path:
        total = sum(_skips.values())
        head = f"skipped or xfailed: {total}, by reason:"
        status = f"pytest exit status: {int(exitstatus)}"
        Path(path).write_text("\n".join([head, *lines, status]) + "\n")


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
    loop (kernels/x86/amx_panel.h); `amx` is skipped where the CPU has no AMX."""
    with native_kernels.gemv.amx_set(request.param == "amx") as on:
        if request.param == "amx" and not on:
            pytest.skip("no AMX on this CPU (or the kernel was not granted the tiles)")
        yield request.param


# -- the image lane's tests on inferd-tiny-sd (a module asks for `one_thread` with
#    `pytestmark = pytest.mark.usefixtures("one_thread")`) -----------------------------------


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The tiny UNet's ops are too small to split: on a shared 2-core machine two OpenMP threads
    ran a step 50x slower than one (spinning against other processes)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's own inferd cache folder."""
    return tmp_path_factory.mktemp("inferd-cache")


@pytest.fixture(scope="module")
def folder(cache_dir: Path) -> Path:
    """inferd-tiny-sd, built in the module's cache folder."""
    from inferd.diffusion.tiny import ensure_tiny_sd

    return ensure_tiny_sd(cache_dir)
