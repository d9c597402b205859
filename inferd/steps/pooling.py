"""`mean_pool`: token embeddings -> one sentence embedding, as sentence-transformers pools.

    - {type: mean_pool, input: token_embeddings, mask: attention_mask, output: embedding,
       normalize: true}

token_embeddings [n, L, H] and attention_mask [n, L'] -> embedding FP32 [n, H]:
sum(emb * mask) / clamp(sum(mask), 1e-9), then (normalize) x / max(||x||, 1e-12), the same
arithmetic as sentence-transformers' Pooling(mean) + Normalize modules. The mask may be
shorter than L (the batch was padded beyond this request's own longest row): the extra
positions are padding, so they count as 0.
"""

from __future__ import annotations

import numpy as np

from inferd.errors import ModelConfigError
from inferd.steps.base import L2_EPS, StepContext, StepOptions, l2_normalize

MASK_EPS = 1e-9  # sentence-transformers clamps the token count to this


def mean_pool(
    token_embeddings: np.ndarray, attention_mask: np.ndarray, normalize: bool = False
) -> np.ndarray:
    """[n, L, H], [n, L] -> [n, H] float32 (padded positions have mask 0)."""
    emb = token_embeddings.astype(np.float32, copy=False)
    mask = attention_mask.astype(np.float32)
    summed = np.einsum("nlh,nl->nh", emb, mask)
    counts = np.maximum(mask.sum(axis=1, keepdims=True), np.float32(MASK_EPS))
    pooled = summed / counts
    return l2_normalize(pooled, -1, L2_EPS) if normalize else pooled


class MeanPoolOptions(StepOptions):
    input: str = "token_embeddings"
    mask: str = "attention_mask"
    output: str = "embedding"
    normalize: bool = False


class MeanPoolStep:
    def __init__(self, options: MeanPoolOptions, ctx: StepContext) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.options = options

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        o = self.options
        emb = self.ctx.take(tensors, o.input)
        mask = self.ctx.take(tensors, o.mask)
        out = {k: v for k, v in tensors.items() if k != o.input}
        out[o.output] = mean_pool(emb, self._align(mask, emb), o.normalize)
        return out

    def _align(self, mask: np.ndarray, emb: np.ndarray) -> np.ndarray:
        if emb.ndim != 3 or mask.ndim != 2 or mask.shape[0] != emb.shape[0]:
            raise ModelConfigError(
                f"{self.ctx.where}: expects {self.options.input} [n, L, H] and "
                f"{self.options.mask} [n, L]; got {list(emb.shape)} and {list(mask.shape)}"
            )
        length = emb.shape[1]
        if mask.shape[1] < length:
            return np.pad(mask, ((0, 0), (0, length - mask.shape[1])))
        if mask.shape[1] > length and mask[:, length:].any():
            raise ModelConfigError(
                f"{self.ctx.where}: {self.options.mask} has real tokens past the "
                f"{length} positions of {self.options.input}"
            )
        return mask[:, :length]
