"""What an image request costs the replica that serves it, in the router's image currency.

    cost = n * steps * (width / 8) * (height / 8)      latent pixel-steps

A denoising step is one UNet forward over the request's latents (width/8 x height/8 for the
VAE's factor 8), and its work grows with the latent pixels; a request runs `steps` of them for
each of its `n` images. Classifier-free guidance doubles every request's rows alike, so it is
left out. The router balances image requests by the pixel-steps each replica has in flight (the
least loaded wins), not by how many requests it has: one 1024x1024 request at 50 steps is worth
sixteen 256x256 requests at 50 steps.

Fields missing from the body count as the router's `image_default_steps` and
`image_default_size` (set them to the served model's defaults); a malformed one counts as its
default too, and the replica answers the 400. The cost is an estimate for routing only: it never
refuses a request.
"""

from __future__ import annotations

import re
from typing import Any

IMAGE_PATHS = ("/v1/images/generations",)
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
_LATENT = 8  # the VAE's scale factor in every Stable Diffusion family


def image_cost(body: Any, default_steps: int, default_size: tuple[int, int]) -> int:
    """The request's latent pixel-steps (at least 1)."""
    doc = body if isinstance(body, dict) else {}
    n = _positive(doc.get("n"), 1)
    steps = _positive(doc.get("num_inference_steps"), default_steps)
    width, height = _size(doc.get("size"), default_size)
    return max(n * steps * -(-width // _LATENT) * -(-height // _LATENT), 1)


def _positive(value: Any, default: int) -> int:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return value if is_int and value > 0 else default


def _size(value: Any, default: tuple[int, int]) -> tuple[int, int]:
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None or not int(match[1]) or not int(match[2]):
        return default
    return int(match[1]), int(match[2])


def parse_size(text: str) -> tuple[int, int]:
    """A `WxH` size; ValueError for anything else.

    >>> parse_size("768x512")
    (768, 512)
    """
    match = _SIZE.match(text)
    if match is None or not int(match[1]) or not int(match[2]):
        raise ValueError(f"a size is WxH with W, H > 0, got {text!r}")
    return int(match[1]), int(match[2])
