"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one model over a flat batch.

The batch has no batch dimension and no padding: T tokens of several sequences laid end to end,
with `positions` [T] and the attention metadata telling which tokens belong together. Every
module maps [T, ...] -> [T, ...].

Family differences are flags on ArchConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE
(Qwen3), bias on o_proj and the MLP (Llama `attention_bias` / `mlp_bias`), tied embeddings.

q/k/v and gate/up are fused into one matmul each (one GEMM instead of three / two, which matters
most for small decode batches on CPU). `checkpoint_layout()` says where each Hugging Face tensor
goes inside the fused parameters.

Parameters are allocated with `torch.empty` (no init kernels): the loader fills every one of them,
so a model built under `torch.device("cuda")` goes straight to the GPU without a CPU copy.

Two paths through a layer, the same math:
- eager PyTorch (CUDA, or no native kernels): each norm, RoPE, SiLU and residual add an op;
- fused (CPU with the native kernels, `use_fused_ops`): per layer, one add + RMSNorm before each
  block (the residual stream is carried beside the hidden state, vLLM's fused_add_rms_norm),
  one q/k norm + RoPE + KV-cache write after the qkv projection, one SiLU * up. The activations
  entering a linear layer are produced already padded to the row count its GEMM runs
  (`linear.padded_rows`), with the extra rows zero, so no op copies them to pad.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.errors import ModelLoadError
from inferd.models.attention import AttentionMetadata, PagedAttention
from inferd.models.config import ArchConfig
from inferd.models.kernels.decode import DecodeLayers, DecodePlan, DecodeShape, LayerWeights
from inferd.models.kernels.fused import FusedOps
from inferd.models.linear import Linear
from inferd.models.quantized import Int8Checkpoint
from inferd.models.rope import RopeCosSin, RotaryEmbedding, apply_rotary

logger = logging.getLogger("inferd.models")


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of `param_name`."""

    param_name: str
    row_start: int
    rows: int


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)

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
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype), False)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        shards = [("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)]
        self.qkv_proj = Linear(cfg.hidden_size, shards, cfg.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, [("o_proj", cfg.hidden_size)], cfg.o_proj_bias, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d**-0.5)

    def forward(self, step: Step, x: Tensor) -> Tensor:
        # x: [T', hidden] (T' = step.padded_rows) -> qkv: [T, (Hq + 2 Hkv) D] -> [T', hidden]
        if step.fused is None:
            assert step.rope is not None
            qkv = self.qkv_proj(x)[: step.rows]
            return self.o_proj(self._eager(step.rope, qkv, step.meta))
        return self.attend(step, self.project_qkv(step, x))

    def project_qkv(self, step: Step, x: Tensor) -> Tensor:
        """Fused path: x [T', hidden] -> rotated q [T, Hq, D]; every row's K/V written."""
        assert step.fused is not None
        qkv = self.qkv_proj(x)[: step.rows]
        return step.fused.rope_qkv(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            step.positions,
            step.rotary.cos_cache,
            step.rotary.sin_cache,
            self.attn.kv_cache,
            step.meta.slot_mapping,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            0.0 if self.q_norm is None else self.q_norm.eps,
        )

    def attend(self, step: Step, q: Tensor) -> Tensor:
        """Fused path: q [T, Hq, D] (contiguous) over the cache -> o_proj's output [T', hidden]."""
        o = self.attn.forward_cached(q, step.meta, step.padded_rows)  # [T', Hq, D]
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
        self.gate_up_proj = Linear(cfg.hidden_size, shards, cfg.mlp_bias, dtype)
        self.down_proj = Linear(inter, [("down_proj", cfg.hidden_size)], cfg.mlp_bias, dtype)

    def forward(self, step: Step, x: Tensor) -> Tensor:
        # x: [T', hidden] -> gate, up: [T, I] -> [T', hidden]
        gate_up = self.gate_up_proj(x)[: step.rows]
        if step.fused is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(step.fused.silu_mul(gate_up, step.padded_rows))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, step: Step, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        # h: this layer's input less the residual stream (None: h is the whole input) -> the same
        # pair after this layer; the caller adds the last layer's two.
        x, residual = self.input_layernorm.add_norm(step, h, residual)
        h = self.self_attn(step, x)[: step.rows]
        x, residual = self.post_attention_layernorm.add_norm(step, h, residual)
        return self.mlp(step, x)[: step.rows], residual

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
        x, residual = self.post_attention_layernorm.add_norm(part, h, residual[keep])
        return self.mlp(part, x)[: part.rows], residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.fused: FusedOps | None = None
        # Decode steps of 1-16 rows (int8: 1-8; with panel copies: 1-128) in one native
        # call (set with the fused ops; see decode_plan).
        self.decode: DecodePlan | None = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        out_rows: Tensor | None = None,
    ) -> Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        t = h.shape[0]
        if out_rows is not None and out_rows.shape[0] == t:
            out_rows = None  # every row (ascending and distinct): nothing to select
        paged, plan = meta.paged, self.decode
        if plan is not None and paged is not None and t <= plan.max_rows and paged.num_seqs == t:
            # Every row a decoding sequence (one query each): the whole step natively.
            return plan(h, positions, meta.slot_mapping, paged)
        # The fused path needs the native attention kernel's batch (it writes K/V for it).
        fused = self.fused if meta.paged is not None else None
        if fused is None:
            # cos/sin of each token's position, gathered once and shared by every layer.
            rope = self.rotary_emb.cos_sin(positions)
            step = Step(positions, meta, t, t, None, self.rotary_emb, rope)
        else:
            rows = self._padded_rows(t)
            step = Step(positions, meta, t, rows, fused, self.rotary_emb)
        residual: Tensor | None = None
        # Rows that do not sample (prefill tokens before a chunk's last) are needed past the last
        # layer's K/V by nothing: there, attention, o_proj and the MLP run for the sampling rows
        # alone. Llama-32m's prompt tokens skip 10 % of their multiply-adds, Qwen2-0.5B's 4 %
        # (docs/benchmarks.md).
        rows_only = step.fused is not None and out_rows is not None and meta.sampled is not None
        layers = list(self.layers)
        for layer in layers[:-1] if rows_only else layers:
            h, residual = layer(step, h, residual)
        if not rows_only:
            out = self.norm.add_norm(step, h, residual, pad=False)[0]
            return out if out_rows is None else out[out_rows]
        assert out_rows is not None and meta.sampled is not None
        n = int(out_rows.shape[0])
        part_meta = AttentionMetadata(slot_mapping=meta.slot_mapping[out_rows], paged=meta.sampled)
        part = Step(positions[out_rows], part_meta, n, self._padded_rows(n), fused, self.rotary_emb)
        last = layers[-1]
        assert isinstance(last, DecoderLayer)
        h, residual = last.forward_rows(step, part, out_rows, h, residual)
        return h if n == 0 else self.norm.add_norm(part, h, residual, pad=False)[0]

    def decode_plan(self, decode: DecodeLayers) -> DecodePlan | None:
        """The native decode step over this model's weights and KV caches, or None when a
        linear layer does not run the GEMV (or the layout is one the kernels do not take)."""
        weights = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            a, m = layer.self_attn, layer.mlp
            lins = [p.gemv_weight() for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            if any(w is None for w in lins):
                return None
            qkv, o, gate_up, down = (w for w in lins if w is not None)
            weights.append(
                LayerWeights(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    None if a.q_norm is None else a.q_norm.weight,
                    None if a.k_norm is None else a.k_norm.weight,
                    a.attn.kv_cache,
                    qkv,
                    o,
                    gate_up,
                    down,
                )
            )
        first = self.layers[0].self_attn
        assert isinstance(first, Attention)
        shape = DecodeShape(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            self.norm.eps,
            0.0 if first.q_norm is None else first.q_norm.eps,
            first.attn.scale,
        )
        rope = self.rotary_emb
        try:
            return decode.plan(weights, self.norm.weight, rope.cos_cache, rope.sin_cache, shape)
        except ValueError as e:
            logger.info("decode steps run layer by layer (native decode step: %s)", e)
            return None

    def _padded_rows(self, rows: int) -> int:
        """The rows the linear layers' GEMMs run for `rows`: all are prepared alike
        (linear.prepare_linears), so the first one's kind and dtype say."""
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        return first.self_attn.qkv_proj.padded_rows(rows)


class LlamaForCausalLM(nn.Module):
    """The model the runner drives: forward() -> hidden states, compute_logits() on sampled rows."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype)
        self.lm_head = Linear(cfg.hidden_size, [("lm_head", cfg.vocab_size)], False, dtype)
        if cfg.tie_word_embeddings:
            # One tensor, two names: the checkpoint stores only model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        out_rows: Tensor | None = None,
    ) -> Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden] (out_rows [N]: [N, hidden])
        return self.model(input_ids, positions, meta, out_rows)

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32 (or, not `float32`, the model dtype)
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def logits_head(self) -> Linear:
        return self.lm_head

    def attention_layers(self) -> list[PagedAttention]:
        return [m.attn for m in self.modules() if isinstance(m, Attention)]

    def use_fused_ops(self, ops: FusedOps | None, decode: DecodeLayers | None = None) -> None:
        """Runs the fused path on batches the native attention kernel serves (None: eager); with
        `decode`, decode steps of 1-16 rows (int8: 1-8; with panel copies: 1-128) run through
        every layer in one native call when every linear layer runs the GEMV. Call after the KV
        caches are bound."""
        self.model.fused = ops
        self.model.decode = None
        if ops is not None and decode is not None:
            self.model.decode = self.model.decode_plan(decode)

    def checkpoint_layout(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> where it lands, for every tensor the checkpoint must hold."""
        layout: dict[str, WeightTarget] = {}
        for module_name, module in self.named_modules():
            if isinstance(module, Linear):
                layout.update(_linear_layout(module_name, module))
            elif isinstance(module, Embedding | RMSNorm):
                name = f"{module_name}.weight"
                layout[name] = WeightTarget(name, 0, module.weight.shape[0])
        if self.config.tie_word_embeddings:
            del layout["lm_head.weight"]
        return layout

    def expect_int8(self, ckpt: Int8Checkpoint) -> list[Linear]:
        """Marks the linear layers an int8 checkpoint stores as int8 (models/quantized.py) and
        returns them; the layers it names in `ignore`, and an lm_head tied to the (float)
        embeddings, stay float (`keep_float`)."""
        int8 = []
        for module_name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            names = [prefix for prefix, _ in _shard_prefixes(module_name, module)]
            ignored = [ckpt.ignores(name) for name in names]
            if any(ignored) and not all(ignored):
                kept = [n for n, i in zip(names, ignored, strict=True) if i]
                raise ModelLoadError(
                    f"the int8 checkpoint leaves {kept} in float but not the other layers of "
                    f"{names}; inferd runs them as one fused layer"
                )
            if all(ignored) or (module_name == "lm_head" and self.config.tie_word_embeddings):
                module.keep_float = True
            else:
                module.expect_int8()
                int8.append(module)
        return int8


def _shard_prefixes(module_name: str, module: Linear) -> list[tuple[str, int]]:
    """Each checkpoint layer stacked into a (fused) Linear, with its rows: "model.layers.0.
    self_attn.qkv_proj" with shard "q_proj" -> "model.layers.0.self_attn.q_proj"."""
    parent = module_name.rpartition(".")[0]
    return [(f"{parent}.{shard}" if parent else shard, rows) for shard, rows in module.shards]


def _linear_layout(module_name: str, module: Linear) -> dict[str, WeightTarget]:
    out: dict[str, WeightTarget] = {}
    start = 0
    for prefix, rows in _shard_prefixes(module_name, module):
        if module.qweight is not None:
            out[f"{prefix}.weight"] = WeightTarget(f"{module_name}.qweight", start, rows)
            out[f"{prefix}.weight_scale"] = WeightTarget(f"{module_name}.weight_scale", start, rows)
        else:
            out[f"{prefix}.weight"] = WeightTarget(f"{module_name}.weight", start, rows)
        if module.bias is not None:
            out[f"{prefix}.bias"] = WeightTarget(f"{module_name}.bias", start, rows)
        start += rows
    return out
