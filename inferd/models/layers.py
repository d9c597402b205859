"""The parts of a decoder layer over the flat batch (models/llama.py assembles them): RMSNorm,
embeddings, attention, the gated MLP or an MoE block, and the layer with its norms.

Two paths through a layer, the same math:
- eager PyTorch (CUDA, or no native kernels): each norm, RoPE, activation and residual add an op;
- fused (CPU with the native kernels): one add + RMSNorm before each block (the residual stream
  is carried beside the hidden state, vLLM's fused_add_rms_norm), one q/k norm + RoPE + KV-cache
  write after the qkv projection, one SiLU * up. The activations entering a linear layer are
  produced already padded to the row count its GEMM runs (`linear.padded_rows`), with the extra
  rows zero, so no op copies them to pad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.models.attention import AttentionMetadata, PagedAttention
from inferd.models.attention.native import NATIVE, NativeMetadata
from inferd.models.config import ArchConfig
from inferd.models.kernels.fused import FusedOps, padded_empty
from inferd.models.kernels.gemv import PanelWeight
from inferd.models.linear import Linear
from inferd.models.moe import SparseMoE
from inferd.models.rope import RopeCosSin, RotaryEmbedding, apply_rotary


@dataclass
class Step:
    """What every layer of one forward shares: the batch's positions and attention metadata, its
    row counts, and which path runs."""

    positions: Tensor  # [T] int64
    meta: AttentionMetadata
    rows: int  # T, the real rows
    # Rows of the activations entering each linear layer (>= rows on the fused path).
    padded_rows: int
    fused: FusedOps | None
    # The model's cos/sin tables (the fused kernel gathers its rows from them).
    rotary: RotaryEmbedding
    # cos, sin of each position, gathered once for every layer (eager path only).
    rope: RopeCosSin | None = None
    # The sliding-window layers' own tables and cos/sin where they have their own (Gemma 3).
    local_rotary: RotaryEmbedding | None = None
    local_rope: RopeCosSin | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: bool = False) -> None:
        """`offset`: the checkpoint's weight w scales by (1 + w) (Gemma); `finish_loading` turns it
        into a plain weight once loaded."""
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)

    def norm(self, step: Step, x: Tensor) -> Tensor:
        """norm(x) [T, dim], unpadded, on either path (no residual)."""
        if step.fused is None:
            return self(x)
        return step.fused.rms_norm(x, self.weight, self.eps, None, step.rows)

    def add_norm(
        self, step: Step, x: Tensor, residual: Tensor | None, pad: bool = True
    ) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x). x: [T, dim]; on the
        fused path the residual is updated in place and the normed rows come padded to
        step.padded_rows (unless not `pad`)."""
        if step.fused is None:
            residual = x if residual is None else x + residual
            return self(residual), residual
        rows = step.padded_rows if pad else step.rows
        out = step.fused.rms_norm(x, self.weight, self.eps, residual, rows)
        return out, x if residual is None else residual

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            # One fused op; bit-for-bit the two-step form below when nothing is cast.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 and scale after casting back, as HF does, so bf16 results match.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, scale: bool = False) -> None:
        """`scale`: rows times sqrt(dim), rounded to the model dtype first as HF does (Gemma)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), False)
        self.scale = float(torch.tensor(dim**0.5).to(dtype)) if scale else None
        # Tied to an lm_head that holds its weight only in panels (models/linear.py).
        self._panel: PanelWeight | None = None

    def read_rows_from(self, panel: PanelWeight) -> None:
        """Rows come from the tied lm_head's panel copy; the dense weight is dropped."""
        self._panel = panel
        self.weight = nn.Parameter(self.weight.detach().new_empty((0, panel.in_features)), False)

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight) if self._panel is None else self._panel.rows(ids)
        return rows if self.scale is None else rows * self.scale


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        shards = [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)]
        if cfg.fused_checkpoint:
            shards = [("qkv_proj", self.q_size + 2 * self.kv_size)]
        self.qkv_proj = Linear(cfg.hidden_size, shards, cfg.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, [("o_proj", cfg.hidden_size)], cfg.o_proj_bias, dtype)
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.q_norm = RMSNorm(d, eps, dtype, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, eps, dtype, offset) if cfg.qk_norm else None
        window = cfg.window(layer)
        scale = cfg.attention_scale or d**-0.5
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, d, scale, window, cfg.attention_sinks
        )
        # Sliding-window layers of a model whose local layers have their own RoPE (Gemma 3).
        self.local_rope = window is not None and cfg.local_rope_theta is not None

    def forward(self, step: Step, x: Tensor) -> Tensor:
        # x: [T', hidden] (T' = step.padded_rows) -> qkv: [T, (Hq + 2 Hkv) D] -> [T', hidden]
        if step.fused is None:
            rope = step.local_rope if self.local_rope else step.rope
            assert rope is not None
            qkv = self.qkv_proj(x)[: step.rows]
            return self.o_proj(self._eager(rope, qkv, step.meta))
        return self.attend(step, self.project_qkv(step, x))

    def project_qkv(self, step: Step, x: Tensor) -> Tensor:
        """Fused path: x [T', hidden] -> rotated q [T, Hq, D]; every row's K/V written."""
        assert step.fused is not None
        qkv = self.qkv_proj(x)[: step.rows]
        rotary = step.local_rotary if self.local_rope else step.rotary
        assert rotary is not None
        return step.fused.rope_qkv(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            step.positions,
            rotary.cos_cache,
            rotary.sin_cache,
            self.attn.kv_cache,
            step.meta.slot_mapping,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            0.0 if self.q_norm is None else self.q_norm.eps,
        )

    def attend(self, step: Step, q: Tensor) -> Tensor:
        """Fused path: q [T, Hq, D] (contiguous) over the cache -> o_proj's output [T', hidden]."""
        assert isinstance(step.meta, NativeMetadata), "the fused path runs the native kernel"
        o = NATIVE.forward_cached(self.attn, q, step.meta, step.padded_rows)  # [T', Hq, D]
        return self.o_proj(o.view(step.padded_rows, self.q_size))

    def _eager(self, rope: RopeCosSin, qkv: Tensor, meta: AttentionMetadata) -> Tensor:
        t = qkv.shape[0]
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attn(q, k, v, meta)  # [T, Hq, D]
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        shards = [("gate_proj", inter), ("up_proj", inter)]
        if cfg.fused_checkpoint:
            shards = [("gate_up_proj", 2 * inter)]
        self.gate_up_proj = Linear(cfg.hidden_size, shards, cfg.mlp_bias, dtype)
        self.down_proj = Linear(inter, [("down_proj", cfg.hidden_size)], cfg.mlp_bias, dtype)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, step: Step, x: Tensor) -> Tensor:
        # x: [T', hidden] -> gate, up: [T, I] -> [T', hidden]
        gate_up = self.gate_up_proj(x)[: step.rows]
        if step.fused is None or self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            if step.fused is None:
                return self.down_proj(act * up)
            out = padded_empty(step.rows, step.padded_rows, (up.shape[1],), up.dtype)
            torch.mul(act, up, out=out[: step.rows])
            return self.down_proj(out)
        return self.down_proj(step.fused.silu_mul(gate_up, step.padded_rows))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        eps, offset, hidden = cfg.rms_norm_eps, cfg.norm_offset, cfg.hidden_size
        self.self_attn = Attention(cfg, dtype, layer)
        moe = cfg.moe if cfg.moe is not None and cfg.moe.sparse_layers[layer] else None
        # The MLP, or the MoE block under its checkpoint name (Qwen: mlp; Mixtral:
        # block_sparse_moe).
        self.ffn_name = "block_sparse_moe" if moe is not None and moe.style == "mixtral" else "mlp"
        ffn = MLP(cfg, dtype) if moe is None else SparseMoE(cfg, moe, dtype)
        self.add_module(self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, offset)
        # Llama: the norm before the MLP. Gemma 3 (sandwich norms): the norm of attention's
        # output, with pre_/post_feedforward_layernorm around the MLP.
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, offset)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, offset)

    @property
    def ffn(self) -> MLP | SparseMoE:
        module = getattr(self, self.ffn_name)
        assert isinstance(module, MLP | SparseMoE)
        return module

    def forward(self, step: Step, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        # h: this layer's input less the residual stream (None: h is the whole input) -> the same
        # pair after this layer; the caller adds the last layer's two.
        x, residual = self.input_layernorm.add_norm(step, h, residual)
        h = self.self_attn(step, x)[: step.rows]
        return self.feed_forward(step, h, residual)

    def feed_forward(self, step: Step, h: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Attention's output h [T, hidden] and the residual stream -> the layer's output less
        the residual, and the residual updated."""
        if not self.sandwich:
            x, residual = self.post_attention_layernorm.add_norm(step, h, residual)
            return self.ffn(step, x)[: step.rows], residual
        h = self.post_attention_layernorm.norm(step, h)
        x, residual = self.pre_feedforward_layernorm.add_norm(step, h, residual)
        out = self.ffn(step, x)[: step.rows]
        return self.post_feedforward_layernorm.norm(step, out), residual

    def forward_rows(
        self, step: Step, part: Step, keep: Tensor, h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """forward() (fused path) for rows `keep` only, `part` their Step: every row's K/V is
        written (later tokens attend to it), but only the kept rows attend and go through o_proj
        and the MLP. The model's last layer, whose other rows have no use past their K/V."""
        x, residual = self.input_layernorm.add_norm(step, h, residual)
        q = self.self_attn.project_qkv(step, x)[keep]
        if part.rows == 0:
            return h.new_empty(0, h.shape[1]), residual[keep]
        h = self.self_attn.attend(part, q)[: part.rows]
        return self.feed_forward(part, h, residual[keep])
