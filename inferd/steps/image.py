"""`image`: JPEG/PNG bytes -> a normalized FP32 tensor.

    - {type: image, input: image, output: input, size: [224, 224], resample: bilinear,
       center_crop: [200, 200], mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225],
       layout: NCHW}

image BYTES [n] or [n, 1] -> output FP32 [n, C, H, W] (NCHW) or [n, H, W, C] (NHWC).
Per image: decode (Pillow; only JPEG and PNG are accepted), convert to RGB (or L), resize to
`size` [h, w], optionally center-crop to `center_crop` [h, w], then x * scale, (x - mean) / std
per channel. Undecodable bytes, another format, or an image over `max_pixels` -> 400.
"""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError
from pydantic import Field, model_validator

from inferd.errors import InvalidRequestError
from inferd.steps.base import StepContext, StepOptions

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
FORMATS = ("JPEG", "PNG")


class ImageOptions(StepOptions):
    input: str = "image"
    output: str = "pixel_values"
    size: tuple[int, int]  # [height, width] after resizing
    resample: Literal["nearest", "bilinear", "bicubic", "lanczos", "box", "hamming"] = "bilinear"
    center_crop: tuple[int, int] | None = None  # [height, width], at most `size`
    color: Literal["RGB", "L"] = "RGB"
    scale: float = 1.0 / 255.0  # uint8 -> 0..1
    mean: tuple[float, ...] | None = None  # one per channel; None: 0
    std: tuple[float, ...] | None = None  # one per channel; None: 1
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    # Decoded pixels per image; the header is checked before decoding, so a small file that
    # claims a huge image (a decompression bomb) is refused without allocating it.
    max_pixels: int = Field(default=40_000_000, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ImageOptions:
        if min(self.size) < 1:
            raise ValueError("size: [height, width] must be positive")
        if self.center_crop is not None and (
            min(self.center_crop) < 1
            or any(c > s for c, s in zip(self.center_crop, self.size, strict=True))
        ):
            raise ValueError(
                f"center_crop {list(self.center_crop)} must fit in size {list(self.size)}"
            )
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None and len(values) != self.channels:
                raise ValueError(f"{name}: needs {self.channels} values for color {self.color}")
        if self.std is not None and any(s == 0 for s in self.std):
            raise ValueError("std: values must be non-zero")
        return self

    @property
    def channels(self) -> int:
        return 3 if self.color == "RGB" else 1


class ImageStep:
    def __init__(self, options: ImageOptions, ctx: StepContext) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.options = options
        channels = options.channels
        self._mean = np.asarray(options.mean or (0.0,) * channels, dtype=np.float32)
        self._std = np.asarray(options.std or (1.0,) * channels, dtype=np.float32)

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        name = self.options.input
        blobs = _blobs(self.ctx.take_rows(tensors, name, "encoded image"), name)
        images = [self.pixels(decode_image(b, name, self.options.max_pixels)) for b in blobs]
        batch = np.stack(images) if images else self._empty()
        batch = (batch * np.float32(self.options.scale) - self._mean) / self._std  # [n, H, W, C]
        if self.options.layout == "NCHW":
            batch = batch.transpose(0, 3, 1, 2)
        out = {k: v for k, v in tensors.items() if k != name}
        out[self.options.output] = np.ascontiguousarray(batch, dtype=np.float32)
        return out

    def pixels(self, image: Image.Image) -> np.ndarray:
        """Color-convert, resize and crop one image: float32 [H, W, C], not yet normalized."""
        o = self.options
        height, width = o.size
        if image.mode != o.color:  # convert() to the same mode would only copy it
            image = image.convert(o.color)
        image = image.resize((width, height), _RESAMPLE[o.resample])
        if o.center_crop is not None:
            ch, cw = o.center_crop
            top, left = (height - ch) // 2, (width - cw) // 2
            image = image.crop((left, top, left + cw, top + ch))
        array = np.asarray(image, dtype=np.float32)
        return array[:, :, None] if array.ndim == 2 else array

    def _empty(self) -> np.ndarray:
        height, width = self.options.center_crop or self.options.size
        return np.zeros((0, height, width, len(self._mean)), dtype=np.float32)


def _blobs(rows: np.ndarray, name: str) -> list[bytes]:
    blobs = []
    for item in rows:
        if not isinstance(item, bytes | bytearray | np.bytes_):
            raise InvalidRequestError(f"input {name!r}: expected BYTES (encoded images)", name)
        blobs.append(bytes(item))
    return blobs


def decode_image(blob: bytes, name: str = "image", max_pixels: int = 40_000_000) -> Image.Image:
    """Decode JPEG/PNG bytes fully (so corrupt data fails here, as a 400, not later)."""
    try:
        image = Image.open(io.BytesIO(blob), formats=FORMATS)
        if image.width * image.height > max_pixels:
            raise InvalidRequestError(
                f"input {name!r}: image is {image.width}x{image.height}, over the "
                f"{max_pixels}-pixel limit",
                name,
            )
        image.load()
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"input {name!r}: image too large: {e}", name) from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        # Pillow signals truncated or corrupt data with OSError, ValueError or SyntaxError.
        raise InvalidRequestError(
            f"input {name!r}: not a decodable JPEG or PNG image: {e}", name
        ) from e
    return image
