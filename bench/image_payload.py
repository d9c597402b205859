"""What an image answer costs the server after denoising, per protocol (offline, no server).

    .venv/bin/python bench/image_payload.py                      # 512x512 and 1024x1024, n = 1
    .venv/bin/python bench/image_payload.py --sizes 512 --n 4 --repeats 5

For each size and format, the best of `--repeats` runs of what the gateway does with a finished
request's pixels (inferd/postprocess/image_encode.py, gateway/openai/images.py):

    file       encode to PNG/JPEG/WebP: the raw-bytes answer (`Accept: image/png`)
    b64_json   the same, then base64 and the JSON body: OpenAI's default answer
    kserve     the UINT8 [n, H, W, 3] tensor's bytes: KServe's binary extension (no encode)

and the bytes each puts on the wire. The pixels are a smooth gradient with grain (a PNG of noise
would not compress, one of a flat colour would compress to nothing). Times include no network.
"""

from __future__ import annotations

import argparse
import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from common import save_result

from inferd.postprocess.image_encode import IMAGE_FORMATS, encode_images


def pixels(n: int, side: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side]
    base = np.stack([x * 255 // side, y * 255 // side, (x + y) * 127 // side], -1)
    grain = rng.integers(-6, 7, (n, side, side, 3))
    return np.clip(base[None] + grain, 0, 255).astype(np.uint8)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1000, 2)


def json_body(files: list[bytes]) -> bytes:
    data = [{"b64_json": base64.b64encode(f).decode()} for f in files]
    return orjson.dumps({"created": 0, "data": data, "output_format": "png", "size": "x"})


def measure(n: int, side: int, repeats: int) -> list[dict[str, Any]]:
    px = pixels(n, side)
    rows: list[dict[str, Any]] = []
    kserve_ms = best_ms(lambda: px.tobytes(), repeats)
    rows.append({"size": side, "n": n, "answer": "kserve", "ms": kserve_ms, "bytes": px.nbytes})
    for fmt in IMAGE_FORMATS:
        files = encode_images(px, fmt)
        file_ms = best_ms(lambda: encode_images(px, fmt), repeats)  # noqa: B023
        json_ms = best_ms(lambda: json_body(files), repeats)  # noqa: B023
        size = sum(len(f) for f in files)
        rows.append({"size": side, "n": n, "answer": f"file {fmt}", "ms": file_ms, "bytes": size})
        rows.append(
            {
                "size": side,
                "n": n,
                "answer": f"b64_json {fmt}",
                "ms": round(file_ms + json_ms, 2),
                "bytes": len(json_body(files)),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="512,1024", help="image sides, comma-separated")
    p.add_argument("--n", type=int, default=1, help="images per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for side in (int(s) for s in args.sizes.split(",")):
        rows += measure(args.n, side, args.repeats)
    for r in rows:
        print(
            f"{r['size']:5d}  n={r['n']}  {r['answer']:14s} {r['ms']:9.2f} ms {r['bytes']:>10,d} B"
        )
    save_result(args.out, "image_payload", f"n{args.n}", {"rows": rows})


if __name__ == "__main__":
    main()
