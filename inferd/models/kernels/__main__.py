"""`python -m inferd.models.kernels build`: compile the native kernels into the cache now.

Never fails the caller (`make` runs it after install): a machine without a compiler or without
AVX-512 just gets the PyTorch path, and this says why. It tries the build again even where an
earlier one failed (engine starts keep that failure cached, `kernels.build`).
"""

from __future__ import annotations

import sys
import time

from inferd.config import read_environment
from inferd.models.kernels import KernelUnavailable, load


def main(argv: list[str]) -> int:
    if argv[1:] != ["build"]:
        print("usage: python -m inferd.models.kernels build", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        kernel = load(read_environment().cache_dir, retry=True)
    except KernelUnavailable as e:
        print(f"native kernels not built (the PyTorch path will run): {e}")
        return 0
    print(f"native kernels ready in {time.perf_counter() - t0:.1f} s: {kernel.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
