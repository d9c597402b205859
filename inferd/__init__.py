"""inferd: an inference server for LLMs and classic models that shows where every millisecond goes.

The public names load lazily, so `import inferd.scheduler` (pure Python) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferd.engine.llm import LLM
    from inferd.engine.llm_engine import LLMEngine
    from inferd.engine.output_processor import OutputKind
    from inferd.sampling.params import SamplingParams
    from inferd.types import CompletionOutput, RequestOutput

_EXPORTS = {
    "LLM": "inferd.engine.llm",
    "LLMEngine": "inferd.engine.llm_engine",
    "OutputKind": "inferd.engine.output_processor",
    "SamplingParams": "inferd.sampling.params",
    "CompletionOutput": "inferd.types",
    "RequestOutput": "inferd.types",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "OutputKind",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inferd' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
