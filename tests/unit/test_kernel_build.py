"""The native kernels' build cache (`kernels.build`): a build the compiler rejected is cached
under the same key as a library, not compiled again at every start, until it is retried."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import torch

from inferd.config import read_environment
from inferd.models import kernels
from inferd.models.kernels.__main__ import main as build_command

pytestmark = pytest.mark.unit


def _rejecting_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A 'compiler' that answers --version and rejects every build, logging each build it
    was asked for (one line each) in the returned file."""
    log = tmp_path / "builds.log"
    script = tmp_path / "bogus-g++"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "bogus-g++ 1.0"; exit 0; fi\n'
        f'echo build >> "{log}"\n'
        'echo "error: this compiler rejects everything" >&2\n'
        "exit 1\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), log


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_failed_build_is_cached_until_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cxx, log = _rejecting_compiler(tmp_path)
    monkeypatch.setattr(kernels, "compiler", lambda: cxx)
    cache = tmp_path / "cache"
    with pytest.raises(kernels.KernelUnavailable, match="rejects everything"):
        kernels.load(cache)
    assert _builds(log) == 1
    marker = kernels.failure_marker(kernels.library_path(cache, cxx))
    assert marker.exists() and "rejects everything" in marker.read_text()
    assert not kernels.library_path(cache, cxx).exists()

    # The next starts get the same reason, saying where the marker is, without compiling.
    for _ in range(2):
        with pytest.raises(kernels.KernelUnavailable, match="rejects everything") as e:
            kernels.load(cache)
        assert str(marker) in str(e.value)
    monkeypatch.setenv("INFERD_CACHE_DIR", str(cache))
    monkeypatch.delenv("INFERD_DISABLE_KERNELS", raising=False)
    cpu, f32 = torch.device("cpu"), torch.float32
    assert kernels.select("auto", cpu, f32, f32, 64, read_environment()) is None
    assert _builds(log) == 1

    # `python -m inferd.models.kernels build` tries again (and never fails its caller).
    assert build_command(["kernels", "build"]) == 0
    assert _builds(log) == 2
    # So does deleting the marker.
    marker.unlink()
    with pytest.raises(kernels.KernelUnavailable):
        kernels.load(cache)
    assert _builds(log) == 3


def test_a_compiler_that_does_not_run_is_not_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A timeout or a compiler that cannot start may pass (a busy machine): the next start tries.
    cxx, _ = _rejecting_compiler(tmp_path)
    monkeypatch.setattr(kernels, "compiler", lambda: cxx)

    def cannot_run(*args: object) -> None:
        raise kernels.KernelUnavailable("compiler failed to run: timed out")

    monkeypatch.setattr(kernels, "compile_library", cannot_run)
    with pytest.raises(kernels.KernelUnavailable, match="timed out"):
        kernels.load(tmp_path)
    assert not kernels.failure_marker(kernels.library_path(tmp_path, cxx)).exists()


AMX = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")
NO_BF16 = ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def _syntax_check(flags: tuple[str, ...], sources: list[Path]) -> None:
    """Compiles `sources` with the library's flags and `flags`, without code generation
    (templates are instantiated), skipping where this machine or compiler cannot."""
    cxx = kernels.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, *kernels.FLAGS, *flags, "-fsyntax-only", *map(str, sources)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and "AVX-512 F/BW/VL/VNNI" in res.stderr:
        pytest.skip("no AVX-512 VNNI here: the native kernels do not build")
    if res.returncode != 0 and "-m" in res.stderr and "unrecognized" in res.stderr:
        pytest.skip(f"{cxx} does not take {' '.join(flags)}")
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_amx_paths_compile() -> None:
    # This machine may have no AMX (its tests then skip): the tile code (kernels/x86/amx*.h, under
    # INFERD_AMX) must still compile.
    here = Path(kernels.__file__).parent
    names = ("panel_gemm.cpp", "greedy.cpp", "moe_experts.cpp", "paged_attention.cpp")
    _syntax_check(AMX, [here / s for s in names])


@pytest.mark.parametrize("flags", [AMX, NO_BF16], ids=["amx", "no_bf16"])
def test_every_header_compiles_on_its_own(flags: tuple[str, ...], tmp_path: Path) -> None:
    # Each header includes what it uses, with AMX and on a CPU class without AVX512_BF16 (whose
    # headers then leave their BF16-only parts out).
    units = []
    for header in kernels.HEADERS:
        unit = tmp_path / f"{header.stem}.cpp"
        unit.write_text(f'#include "{header}"\n')
        units.append(unit)
    _syntax_check(flags, units)
