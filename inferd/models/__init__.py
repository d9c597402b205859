"""Model definitions, the architecture registry, and weight loading.

config.py (ArchConfig from config.json) -> registry.py (architecture -> class) -> llama.py (the
Llama family over a flat batch, rope.py for positions) -> loader.py (folder resolution and weights);
tiny.py builds the built-in `inferd-tiny` folder.
"""

from inferd.models.config import ArchConfig
from inferd.models.loader import load_model, resolve_model_path
from inferd.models.registry import SUPPORTED_ARCHITECTURES, CausalLM, get_model_class

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "CausalLM",
    "get_model_class",
    "load_model",
    "resolve_model_path",
]
