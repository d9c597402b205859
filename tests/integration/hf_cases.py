"""Model-config pieces shared by the tests that compare inferd with Hugging Face transformers."""

from __future__ import annotations

from typing import Any

# Llama 3.1's rope scaling for tiny test models: with an original context of 64, the wavelengths of
# head_dim 16 fall in all three llama3 bands.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
