"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from inferd.errors import ModelLoadError
from inferd.models.attention import AttentionMetadata, PagedAttention
from inferd.models.config import SUPPORTED_ARCHITECTURES
from inferd.models.kernels.decode import DecodeLayers
from inferd.models.kernels.fused import FusedOps
from inferd.models.linear import Linear, LowRankRows
from inferd.models.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "get_model_class"]


class CausalLM(Protocol):
    """What the model runner needs from any model class (all are nn.Modules too)."""

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        out_rows: Tensor | None = None,
    ) -> Tensor:
        """[T] token ids and positions of the flat batch -> [T, hidden]; with `out_rows` [N]
        (ascending), only those rows' hidden states, [N, hidden]."""
        ...

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (not `float32`: in the model dtype, for a caller
        that converts only what needs it)."""
        ...

    def logits_head(self) -> Linear | None:
        """The Linear that compute_logits is and nothing more (so that the greedy screen can
        stand in for it), or None."""
        ...

    def attention_layers(self) -> list[PagedAttention]: ...

    def use_lora(self, rows: LowRankRows) -> list[tuple[str, Linear]]:
        """LoRA on: steps with adapter rows run layer by layer; the layers adapters may
        target, by name."""
        ...

    def use_fused_ops(self, ops: FusedOps | None, decode: DecodeLayers | None = None) -> None:
        """Fused elementwise kernels for batches the native attention kernel serves, and the
        native decode step for 1-2 row decode batches."""
        ...


# One implementation covers the family; the differences are ArchConfig flags.
# docs/models.md lists them with what each needs.
_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    # Its text tower (config.json's text_config; the loader skips the vision tower's tensors).
    "Gemma3ForConditionalGeneration": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    # Attention sinks, YaRN, biased MoE with a clamped SwiGLU, MXFP4 experts (models/gpt_oss.py).
    "GptOssForCausalLM": LlamaForCausalLM,
}

assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES), "config.py and the registry disagree"


def get_model_class(architecture: str, source: str = "config.json") -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None
