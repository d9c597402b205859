"""Folders built once into the cache on first use (`inferd-tiny`, `inferd-tiny-sd`, ...).

    final = build_once(cache_dir / "models" / "inferd-tiny-v1", write_folder)

The folder is written in a temporary sibling and renamed into place: rename is atomic, so a
concurrent first use sees no folder or a complete one, and the loser of a race discards its copy.
A folder that exists is used as it is: its name carries the version of what writes it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(final: Path, write: Callable[[Path], object]) -> Path:
    """`final`, written by `write(tmp)` if it does not exist yet."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
