"""Native CPU kernels: build once, cache, load, or say why not (the caller then uses PyTorch).

`paged_attention.cpp` (attention over the paged KV cache; its paths per instruction set in
`x86/*_attention.h`), `fused_ops.cpp` (a decoder layer's elementwise ops fused: add + RMSNorm,
SiLU * up, q/k norm + RoPE + KV-cache write; `fused.py`) and
`gemv.cpp` (int8 linear layers of 1-8 rows, at memory speed; `gemv.py`), `panel_gemm.cpp`
(batches of up to 128 rows on weights packed in panels, `gemv.py`; the op in `panel.h`, its loops
per instruction set in `x86/`: AVX-512, and AMX tiles where the CPU has them, whose permission and
configuration `x86/amx.h` shares with attention), `greedy.cpp` (the int8 greedy screen
of the lm_head over the same loop and the candidates' exact logits, `greedy.py`),
`decode_step.cpp` (a decode step of up to 128 rows through every layer in one call; `decode.py`)
and `moe_experts.cpp` (an MoE layer past its router in one call, on the same panels; `fused.py`)
are compiled into one plain shared library (no torch headers) with the machine's C++ compiler,
`-O3 -march=native -fopenmp`, and called through ctypes. Why not a
`torch.utils.cpp_extension` TORCH_LIBRARY op — measured here (2 cores, gcc 12, torch 2.13 CPU):

    build, plain .so (this file, 6 head dims)        2.4 s   (no torch headers to parse)
    build, cpp_extension.load_inline (an empty op)   63 s    (torch/extension.h is most of it)
    call overhead, this wrapper (ctypes, 17 args)    5.1 µs  7 data_ptr() calls included
    call overhead, torch.ops dispatcher (7 tensors)  4.3 µs

The plain library builds fast enough to build at engine start when the cache is cold (start-up for
the tiny model stays under 10 s); a torch extension could not (a minute). The ~1 µs more per call
is 8 µs a step on an 8-layer model, against steps of milliseconds. OpenMP threads: the library needs
libgomp.so.1 by soname, which the dynamic loader resolves to the copy torch already loaded, so the
kernel runs on torch's own thread pool (`torch.set_num_threads` applies) instead of a second pool
whose spinning workers would fight torch's on a 2-core machine.

The build is cached under `<cache dir>/kernels/`, keyed by a hash of the source, the compiler's
version, the flags and the CPU's feature flags, so a new compiler, a different CPU or an edited
kernel rebuilds, and nothing else does. A build the compiler rejects is cached too, as a marker
holding its reason under the same key, so a start does not pay for the failing compile again and
the reason is logged once per start; deleting the marker, or `python -m inferd.models.kernels
build`, which prebuilds the library (`make` runs it after install), tries again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from inferd.config import Environment, read_environment
from inferd.errors import ModelLoadError
from inferd.models.kernels.decode import DecodeLayers
from inferd.models.kernels.fused import DTYPE_CODES, KV_DTYPE_CODES, FusedOps
from inferd.models.kernels.gemv import Gemv
from inferd.models.kernels.greedy import GreedyScreen

logger = logging.getLogger("inferd.executor")

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / f
    for f in (
        "paged_attention.cpp",
        "fused_ops.cpp",
        "gemv.cpp",
        "panel_gemm.cpp",
        "greedy.cpp",
        "decode_step.cpp",
        "moe_experts.cpp",
    )
)
# Hashed with the sources (a header edit must rebuild too), not passed to the compiler.
HEADERS = tuple(sorted(_HERE.rglob("*.h")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128, 256})
_BUILD_TIMEOUT_S = 120


class KernelUnavailable(ModelLoadError):
    """The native kernel cannot be built or loaded here; the message says why.

    The engine falls back to PyTorch unless `attention_backend=cpu_kernel` asked for the kernel,
    where start-up fails with this error (a ModelLoadError, like any other start-up failure)."""


@dataclass
class PagedBatch:
    """Sequences whose queries the kernel serves, all int32 on CPU.

    Sequence s owns queries [q_start[s], q_start[s] + q_len[s]) of the flat batch and ctx_len[s]
    keys in the cache (after this step's write); query j sees keys [0, ctx_len - q_len + j]
    (with a sliding window W, the last W of them). Decode is q_len = 1; a prefill chunk with a
    cached prefix is q_len = chunk length.
    """

    block_tables: Tensor  # [S, max_blocks] int32
    q_start: Tensor  # [S] int32
    q_len: Tensor  # [S] int32
    ctx_len: Tensor  # [S] int32

    @property
    def num_seqs(self) -> int:
        return int(self.q_start.shape[0])


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library: its attention kernel, fused elementwise ops, small-batch GEMV, the
    decode step that chains them through every layer and the greedy lm_head screen."""

    path: Path
    attention: PagedAttentionKernel
    ops: FusedOps
    gemv: Gemv
    decode: DecodeLayers
    screen: GreedyScreen


class PagedAttentionKernel:
    """`__call__` writes the rows of `out` that `batch` covers."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.inferd_paged_attention
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, i32, ptr, i32, i64, i32, i32, i32, i32]
        fn.argtypes += [ptr, i32, ptr, ptr, ptr, i32, ctypes.c_float, i32, ptr]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        out: Tensor,
        q: Tensor,
        kv_cache: Tensor,
        batch: PagedBatch,
        scale: float,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> None:
        # out, q: [T, Hq, D] contiguous  kv_cache: [2, NB, bs, Hkv, D (+ 4 if int8)] contiguous
        # window: each query sees its last `window` keys only (None: all before it)
        # sinks: [Hq] float32 contiguous, a logit per query head in its softmax (None: none)
        assert out.is_contiguous() and q.is_contiguous() and kv_cache.is_contiguous()
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.is_contiguous()
            assert sinks.shape == (q.shape[1],)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        head_dim = q.shape[2]
        tables = batch.block_tables
        rc = self._fn(
            out.data_ptr(),
            q.data_ptr(),
            DTYPE_CODES[q.dtype],
            kv_cache.data_ptr(),
            KV_DTYPE_CODES[kv_cache.dtype],
            num_blocks,
            block_size,
            q.shape[1],
            num_kv_heads,
            head_dim,
            tables.data_ptr(),
            tables.shape[1],
            batch.q_start.data_ptr(),
            batch.q_len.data_ptr(),
            batch.ctx_len.data_ptr(),
            batch.num_seqs,
            scale,
            window or 0,
            None if sinks is None else sinks.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"paged attention kernel rejected its arguments (rc={rc})")


def select(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    env: Environment,
) -> NativeKernels | None:
    """The kernels the engine should use, or None for the PyTorch path; logs the choice once.

    backend is CacheConfig.attention_backend: "torch" never loads it, "cpu_kernel" raises
    KernelUnavailable when it cannot run, "auto" falls back quietly (one log line).
    """
    if backend == "torch" or (backend == "auto" and device.type != "cpu"):
        return None
    why = _why_not(device, dtype, kv_dtype, head_dim, env)
    kernel = None
    if why is None:
        try:
            kernel = load(env.cache_dir)
        except KernelUnavailable as e:
            why = str(e)
    if kernel is not None:
        logger.info("attention and fused ops: native CPU kernels (%s)", kernel.path.name)
        return kernel
    if backend == "cpu_kernel":
        raise KernelUnavailable(f"attention_backend=cpu_kernel, but: {why}")
    logger.info("attention: PyTorch path (native kernel not used: %s)", why)
    return None


def _why_not(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, env: Environment
) -> str | None:
    if device.type != "cpu":
        return f"device {device} (the kernel is CPU-only)"
    if env.disable_kernels:
        return "INFERD_DISABLE_KERNELS is set"
    return supports(dtype, kv_dtype, head_dim)


def kernel_available(env: Environment | None = None) -> bool:
    """Whether the kernel builds and loads here (tests use it to know which path ran)."""
    env = env or read_environment()
    if env.disable_kernels:
        return False
    try:
        load(env.cache_dir)
    except KernelUnavailable:
        return False
    return True


def supports(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the kernel handles this shape, else why not."""
    if dtype not in DTYPE_CODES or kv_dtype not in KV_DTYPE_CODES:
        return (
            f"dtype {dtype} / KV cache dtype {kv_dtype} (float32 and bfloat16; float8_e5m2 and "
            "int8 for the KV cache)"
        )
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (supported: {sorted(HEAD_DIMS)})"
    return None


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def library_path(cache_dir: Path, cxx: str) -> Path:
    """Where the build for this source, compiler, flags and CPU lives."""
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    h.update(_compiler_version(cxx).encode())
    h.update(" ".join(FLAGS).encode())
    h.update(_cpu_flags().encode())
    return cache_dir / "kernels" / f"inferd_kernels-{h.hexdigest()[:16]}.so"


class BuildFailed(KernelUnavailable):
    """The compiler ran and rejected the sources: the same build would fail again."""


def build(cache_dir: Path, retry: bool = False) -> Path:
    """The cached library, compiled first if absent. Raises KernelUnavailable.

    A build the compiler rejected leaves its reason in a marker beside where the library would
    be (`failure_marker`), and later calls raise it without compiling again, until the marker is
    deleted or `retry` (`python -m inferd.models.kernels build`) deletes it. A compiler that did
    not run or timed out (a busy machine) leaves none: the next start tries again."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (g++/c++) on PATH")
    path = library_path(cache_dir, cxx)
    if path.exists():
        return path
    marker = failure_marker(path)
    if retry:
        marker.unlink(missing_ok=True)
    elif marker.exists():
        reason = marker.read_text(errors="replace")
        raise KernelUnavailable(f"{reason} (cached: delete {marker} to retry)")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _atomic(path, lambda tmp: compile_library(cxx, SOURCES, tmp))
    except BuildFailed as e:
        reason = str(e)
        _atomic(marker, lambda tmp: tmp.write_text(reason))
        raise
    return path


def failure_marker(library: Path) -> Path:
    """Where a failed build of `library` records why (keyed by the same hash)."""
    return library.with_suffix(".failed")


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Writes `path` through a temporary name and a rename: concurrent builders never see a
    half-written file."""
    fd, tmp = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def compile_library(
    cxx: str, sources: Sequence[Path], out: Path, extra_flags: Sequence[str] = ()
) -> None:
    """Compiles `sources` (the .cpp files; their headers beside them) into the shared library
    `out` with the engine's flags (then `extra_flags`). Raises BuildFailed where the compiler
    rejects them, KernelUnavailable where it does not run."""
    cmd = [cxx, *FLAGS, *extra_flags, *(str(s) for s in sources), "-o", str(out)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"compiler failed to run: {e}") from e
    if res.returncode != 0:
        raise BuildFailed(f"build failed: {res.stderr.strip()[-2000:]}")


def load(cache_dir: Path, retry: bool = False) -> NativeKernels:
    """Build if needed (`build`; `retry`: even after a cached failure) and load. Raises
    KernelUnavailable."""
    path = build(cache_dir, retry)
    try:
        lib = ctypes.CDLL(str(path))
        return NativeKernels(
            path,
            PagedAttentionKernel(lib),
            FusedOps(lib),
            Gemv(lib),
            DecodeLayers(lib),
            GreedyScreen(lib),
        )
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e


@functools.cache  # one subprocess per process, not per engine
def _compiler_version(cxx: str) -> str:
    try:
        res = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"compiler {cxx} does not run: {e}") from e
    return f"{cxx}\n{res.stdout}"


@functools.cache
def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return " ".join(sorted(line.split(":", 1)[1].split()))
    return ""
