"""The Llama family and its relatives as one model over a flat batch: Llama 2/3, Mistral, Qwen2,
Qwen3, Gemma 3, Phi-3, and the mixture-of-experts Qwen3-MoE and Mixtral.

The batch has no batch dimension and no padding: T tokens of several sequences laid end to end,
with `positions` [T] and the attention metadata telling which tokens belong together. Every
module maps [T, ...] -> [T, ...].

Family differences are flags on ArchConfig: q/k/v bias (Qwen2), per-head q/k RMSNorm before RoPE
(Qwen3, Gemma 3), bias on o_proj and the MLP (Llama `attention_bias` / `mlp_bias`), tied
embeddings, a sliding window per layer (Mistral: all; Gemma 3: its local layers, which have their
own RoPE base), Gemma's (1 + weight) norms (folded into the weight once loaded: `finish_loading`),
scaled embeddings, norms after attention and the MLP too, GELU-tanh, `query_pre_attn_scalar`
and logit soft-capping, Phi-3's fused checkpoint tensors, and an MoE block in place of the MLP
(models/moe.py).

q/k/v and gate/up are fused into one matmul each (one GEMM instead of three / two, which matters
most for small decode batches on CPU). `checkpoint_layout()` says where each Hugging Face tensor
goes inside the fused parameters.

Parameters are allocated with `torch.empty` (no init kernels): the loader fills every one of them,
so a model built under `torch.device("cuda")` goes straight to the GPU without a CPU copy.

The layers' parts (and their two paths, eager and fused) are in models/layers.py.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from inferd.errors import ModelLoadError
from inferd.models.attention import AttentionMetadata, PagedAttention
from inferd.models.attention.native import NativeMetadata
from inferd.models.config import ArchConfig
from inferd.models.kernels.decode import DecodeLayers, DecodePlan, DecodeShape, LayerWeights
from inferd.models.kernels.fused import FusedOps
from inferd.models.layers import (
    Attention,
    DecoderLayer,
    Embedding,
    RMSNorm,
    Step,
)
from inferd.models.linear import Linear, LowRankRows
from inferd.models.moe import SparseMoE
from inferd.models.quantized import Int8Checkpoint
from inferd.models.rope import RotaryEmbedding
from inferd.models.weights import WeightTarget

__all__ = ["DecoderLayer", "LlamaForCausalLM", "Step", "WeightTarget"]

logger = logging.getLogger("inferd.models")


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, cfg.scale_embeddings)
        positions, max_pos = cfg.max_context_len, cfg.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, dtype, positions
        )
        # Gemma 3's local layers: their own base (and scaling), the same positions.
        self.local_rotary_emb = None
        if cfg.local_rope_theta is not None:
            theta, scaling = cfg.local_rope_theta, cfg.local_rope_scaling
            self.local_rotary_emb = RotaryEmbedding(
                cfg.head_dim, max_pos, theta, scaling, dtype, positions
            )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        # The native decode step chains Llama's layer as it is (its MLP or an MoE block): no
        # sandwich norms, GELU, second RoPE table or attention sinks.
        self.plain_layers = not (
            cfg.sandwich_norms
            or cfg.hidden_act != "silu"
            or self.local_rotary_emb is not None
            or cfg.attention_sinks
        )
        self.fused: FusedOps | None = None
        # Steps whose every row samples (decode, verify) of up to 128 rows on panel copies (int8
        # GEMV copies: 1-8) in one native call (set with the fused ops; see decode_plan).
        self.decode: DecodePlan | None = None
        # The LoRA adapters' rows of the step (inferd/lora), when LoRA is on. A step with
        # adapter rows runs layer by layer on every row: the native decode step and the last
        # layer's sampling-rows-only path have no low-rank term.
        self.lora: LowRankRows | None = None

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
        lora = self.lora is not None and self.lora.active
        # The native kernel's metadata (the native attention backend's steps), else None.
        native = meta if isinstance(meta, NativeMetadata) else None
        paged = None if native is None else native.paged
        plan = None if lora else self.decode
        if plan is not None and paged is not None and out_rows is None and plan.takes(t, paged):
            # Every row samples (decode rows; a verify step's rows): the whole step natively.
            return plan(h, positions, meta.slot_mapping, paged)
        # The fused path needs the native attention kernel's batch (it writes K/V for it).
        fused = self.fused if paged is not None else None
        local = self.local_rotary_emb
        if fused is None:
            # cos/sin of each token's position, gathered once and shared by every layer.
            rope = self.rotary_emb.cos_sin(positions)
            local_rope = None if local is None else local.cos_sin(positions)
            step = Step(positions, meta, t, t, None, self.rotary_emb, rope, local, local_rope)
        else:
            rows = self._padded_rows(t)
            step = Step(positions, meta, t, rows, fused, self.rotary_emb, local_rotary=local)
        residual: Tensor | None = None
        # Rows that do not sample (prefill tokens before a chunk's last) are needed past the last
        # layer's K/V by nothing: there, attention, o_proj and the MLP run for the sampling rows
        # alone. Llama-32m's prompt tokens skip 10 % of their multiply-adds, Qwen2-0.5B's 4 %
        # (docs/benchmarks.md).
        rows_only = native is not None and native.sampled is not None and step.fused is not None
        rows_only = rows_only and out_rows is not None and not lora
        layers = list(self.layers)
        for layer in layers[:-1] if rows_only else layers:
            h, residual = layer(step, h, residual)
        if not rows_only:
            out = self.norm.add_norm(step, h, residual, pad=False)[0]
            return out if out_rows is None else out[out_rows]
        assert out_rows is not None and native is not None
        n = int(out_rows.shape[0])
        part = Step(
            positions[out_rows],
            native.sampled_rows(out_rows),
            n,
            self._padded_rows(n),
            fused,
            self.rotary_emb,
            local_rotary=local,
        )
        last = layers[-1]
        assert isinstance(last, DecoderLayer)
        h, residual = last.forward_rows(step, part, out_rows, h, residual)
        return h if n == 0 else self.norm.add_norm(part, h, residual, pad=False)[0]

    def decode_plan(self, decode: DecodeLayers) -> DecodePlan | None:
        """The native decode step over this model's weights and KV caches, or None when a
        linear layer's plan starts with no kernel of the step's (linear.py) or the layout is one
        the kernels do not take."""
        if not self.plain_layers:
            return None
        weights = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            a, m = layer.self_attn, layer.ffn
            moe = m.decode_weights() if isinstance(m, SparseMoE) else None
            mlp = [] if isinstance(m, SparseMoE) else [m.gate_up_proj, m.down_proj]
            lins = [p.gemv_weight() for p in (a.qkv_proj, a.o_proj, *mlp)]
            if any(w is None for w in lins) or (isinstance(m, SparseMoE) and moe is None):
                return None
            qkv, o, *dense = (w for w in lins if w is not None)
            gate_up, down = dense or (None, None)
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
                    a.attn.window or 0,
                    moe,
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
        # The MoE blocks, found once: a walk over an MoE model's ~1,000 modules each step took
        # 16 ms of a step (a plain list: not registered again as children).
        self._moe_blocks = [m for m in self.modules() if isinstance(m, SparseMoE)]

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
        cap = self.config.final_logit_softcapping
        if cap is not None:  # HF's order: / cap, tanh, * cap
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float32 else logits

    def logits_head(self) -> Linear | None:
        # Soft-capped logits are not the head's own (the greedy screen bounds the head's).
        return None if self.config.final_logit_softcapping is not None else self.lm_head

    def expert_rows(self) -> list[int]:
        """Rows routed to each expert since the last call, summed over the MoE layers (empty for
        a dense model): the step statistics' load balance."""
        if not self._moe_blocks:
            return []
        counts = [m.take_counts() for m in self._moe_blocks]
        if self.model.decode is not None:
            counts.append(self.model.decode.take_expert_rows())
        return [sum(c) for c in zip(*counts, strict=True)]

    def finish_loading(self) -> None:
        """Call once, after loading. Gemma's norms scale by (1 + w): w becomes 1 + w (in the
        model dtype), so every path runs a plain RMSNorm. gpt-oss's stacked experts become one
        module each (moe.SparseMoE.split_experts)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm) and module.offset:
                    module.weight.add_(1.0)
                    module.offset = False
        for block in self._moe_blocks:
            block.split_experts()

    def attention_layers(self) -> list[PagedAttention]:
        return [m.attn for m in self.modules() if isinstance(m, Attention)]

    def use_lora(self, rows: LowRankRows) -> list[tuple[str, Linear]]:
        """Steps whose `rows` are active run layer by layer; returns the layers a LoRA adapter
        may target, by name: every decoder layer's linear layers but MoE experts' (and not the
        lm_head)."""
        self.model.lora = rows
        experts = {id(m) for b in self.modules() if isinstance(b, SparseMoE) for m in b.modules()}
        return [
            (name, m)
            for name, m in self.named_modules()
            if isinstance(m, Linear) and name.startswith("model.layers.") and id(m) not in experts
        ]

    def use_fused_ops(self, ops: FusedOps | None, decode: DecodeLayers | None = None) -> None:
        """Runs the fused path on batches the native attention kernel serves (None: eager); with
        `decode`, steps whose every row samples, of up to 128 rows on panel copies (int8 GEMV
        copies: 1-8), run through every layer in one native call where every linear layer's
        plan starts with one of its kernels. Call after the KV caches are bound."""
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
            elif isinstance(module, SparseMoE):
                layout.update(module.layout(module_name))
            elif isinstance(module, PagedAttention) and module.sinks is not None:
                # gpt-oss's sinks: `self_attn.sinks` in the checkpoint.
                name = f"{module_name.removesuffix('.attn')}.sinks"
                layout[name] = WeightTarget(f"{module_name}.sinks", 0, module.num_heads)
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
