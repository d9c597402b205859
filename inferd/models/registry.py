"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from inferd.errors import ModelLoadError
from inferd.models.llama import LlamaForCausalLM

# One implementation covers the family; the differences are ArchConfig flags.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODELS))


def get_model_class(architecture: str, source: str = "config.json") -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
