"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral) over the flat batch.

Each token's router scores every expert (a linear layer without bias), and the token goes to the
`top_k` experts of highest softmax probability, renormalised to sum to 1 where the config says
(`norm_topk_prob`; always for Mixtral). The router runs as Hugging Face runs it — `F.linear` in
the model dtype, the softmax in float32, `torch.topk` — so in float32 the logits and the experts
chosen are transformers' own, bit for bit (the router is a plain parameter: `prepare_linears`
never repacks it, since another GEMM could sum in another order and flip a near tie).

The experts run as grouped GEMMs: the T * k (token, expert) assignments are sorted by expert
(stable, so each expert's rows keep token order), the tokens' rows gathered once in that order,
and each expert that received rows runs one gate/up GEMM, SiLU * up and one down GEMM over its
contiguous slice, never a loop over tokens. The outputs, times their routing weights, are summed
back into each token's row with one index_add_, in ascending expert order per token (the order
transformers adds them in).

Weights: gate and up of every expert stacked in one [E * 2I, H] parameter (expert e's gate rows
at e * 2I, its up rows after them), down in one [E * H, I]; `layout()` maps each expert's
checkpoint tensors (Qwen's `experts.E.{gate,up,down}_proj`, Mixtral's `experts.E.{w1,w3,w2}`)
into them.

gpt-oss (models/gpt_oss.py) adds three hooks: biases on the router and on each expert's gate/up
and down (`router_bias`, `b13`, `b2`), its routing (a softmax over the top k logits) and its
clamped SwiGLU in place of SiLU(gate) * up; its checkpoint layout is its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.models import gpt_oss
from inferd.models.config import ArchConfig, MoEConfig
from inferd.models.weights import WeightTarget

# Checkpoint names of each expert's gate, up and down projections, per naming style.
_EXPERT_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = moe.num_experts, cfg.hidden_size, moe.intermediate_size
        self.num_experts, self.top_k, self.inter = e, moe.top_k, i
        self.norm_topk_prob = moe.norm_topk_prob
        self.style = moe.style
        # The router's weight: checkpoint name `<block>.gate.weight`.
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype), False)
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, h, dtype=dtype), False)
        self.w2 = nn.Parameter(torch.empty(e * h, i, dtype=dtype), False)
        self.spec = moe
        # gpt-oss: biases on the router and the experts' two GEMMs (None: none).
        biased = moe.style == "gpt_oss"
        self.router_bias = nn.Parameter(torch.empty(e, dtype=dtype), False) if biased else None
        self.b13 = nn.Parameter(torch.empty(e * 2 * i, dtype=dtype), False) if biased else None
        self.b2 = nn.Parameter(torch.empty(e * h, dtype=dtype), False) if biased else None
        # Rows routed to each expert by the forwards since `take_counts` (step statistics).
        self.counts: list[int] = [0] * e

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k] int64), as HF's router."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        if self.style == "gpt_oss":
            return gpt_oss.route(logits, self.top_k)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w /= top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_i

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, H] -> [T, H]
        h = x.shape[1]
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * k]: assignment a is token a // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        rows = order // self.top_k  # the token of each sorted assignment
        xs = x.index_select(0, rows)  # [T * k, H], grouped by expert
        out = torch.empty_like(xs)
        w13 = self.w13.view(self.num_experts, 2 * self.inter, h)
        w2 = self.w2.view(self.num_experts, h, self.inter)
        start = 0
        for e, n in enumerate(counts):
            if n:
                sl = slice(start, start + n)
                gate, up = F.linear(xs[sl], w13[e], self._bias(self.b13, e)).chunk(2, dim=-1)
                out[sl] = F.linear(self._act(gate, up), w2[e], self._bias(self.b2, e))
                start += n
        out *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, rows, out)

    def _act(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.style == "gpt_oss":
            return gpt_oss.clamped_swiglu(gate, up, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        return F.silu(gate) * up

    def _bias(self, bias: Tensor | None, expert: int) -> Tensor | None:
        """Expert `expert`'s part of a stacked bias (None: no bias)."""
        return None if bias is None else bias.view(self.num_experts, -1)[expert]

    def take_counts(self) -> list[int]:
        """Rows routed to each expert since the last call (and start counting again)."""
        counts, self.counts = self.counts, [0] * self.num_experts
        return counts

    def layout(self, prefix: str, params: str) -> dict[str, WeightTarget]:
        """Checkpoint tensor name -> target: `prefix` the block's name in the checkpoint
        (`model.layers.0.mlp` / `model.layers.0.block_sparse_moe`), `params` this module's."""
        i, h = self.inter, self.router.shape[1]
        if self.style == "gpt_oss":
            return gpt_oss.expert_layout(prefix, params, self.num_experts, h, i, self.spec.mxfp4)
        gate, up, down = _EXPERT_NAMES[self.style]
        out = {f"{prefix}.gate.weight": WeightTarget(f"{params}.router", 0, self.num_experts)}
        for e in range(self.num_experts):
            name = f"{prefix}.experts.{e}"
            out[f"{name}.{gate}.weight"] = WeightTarget(f"{params}.w13", e * 2 * i, i)
            out[f"{name}.{up}.weight"] = WeightTarget(f"{params}.w13", e * 2 * i + i, i)
            out[f"{name}.{down}.weight"] = WeightTarget(f"{params}.w2", e * h, h)
        return out
