"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral) over the flat batch.

Each token's router scores every expert (a linear layer without bias), and the token goes to the
`top_k` experts of highest softmax probability, renormalised to sum to 1 where the config says
(`norm_topk_prob`; always for Mixtral). The router runs as Hugging Face runs it — `F.linear` in
the model dtype, the softmax in float32, `torch.topk` — so in float32 the logits and the experts
chosen are transformers' own, bit for bit (the router is a plain parameter, not a `Linear`:
`prepare_linears` never repacks it, since another GEMM could sum in another order and flip a
near tie).

The experts run as grouped GEMMs: the T * k (token, expert) assignments are sorted by expert
(stable, so each expert's rows keep token order), the tokens' rows gathered once in that order,
and each expert that received rows runs one gate/up GEMM, SiLU * up and one down GEMM over its
contiguous slice, never a loop over tokens. The outputs, times their routing weights, are summed
back into each token's row with one index_add_, in ascending expert order per token (the order
transformers adds them in).

Each expert is two `Linear` layers (`Expert`): gate and up stacked in `gate_up_proj`, as the
dense MLP's, and `down_proj`, under the checkpoint's names (the block sits at the checkpoint's
path, `model.layers.N.mlp` or `.block_sparse_moe`, its experts at `experts.E`, and the shards
carry Qwen's `gate_proj`/`up_proj`/`down_proj` or Mixtral's `w1`/`w3`/`w2`). So `prepare_linears`
gives every expert the dense layers' dispatch plan (models/linear.py): on CPU the panel GEMM at
any row count in float32 and bfloat16, int8 with `--quantization int8` (the int8 GEMV at 1-2
rows, a decode step's usual count per expert), each weight held once in its kernel's layout;
an int8 checkpoint's experts load as any int8 linear layer.

Where every expert's plan starts with a native kernel, everything past the router is one
native call (`FusedOps.moe_layer`, kernels/moe_experts.cpp: the sort, the gather, the experts,
the weighted sum) instead of ~30 ops and calls from Python, for as many rows per expert as that
kernel's route takes (`MoEPanels.max_rows`; an expert given more: the Python path above):
- the panel GEMM (float32 and bfloat16): any row count, all active experts' panels split over
  the threads (a prefill chunk's with SiLU * up and the weighted sums in the panels' epilogues,
  its rows read in place);
- the int8 GEMV (`--quantization int8`): 1-2 rows per expert (a decode step of a few
  sequences), each value computed as the expert's Linear layers compute it, all active
  experts' blocks split over the threads.
It takes the same steps in the same order, rounding where they round, so its output equals
theirs bit for bit (tests/integration/test_families_vs_hf.py). bench/NOTES.md has what it saved.
The one-call decode step (kernels/decode.py) runs the same call inside the step, int8 experts on
the GEMV at each of its row counts (1-8), as it runs int8 dense layers.

gpt-oss (models/gpt_oss.py) differs in three places: a bias on the router, its routing (a
softmax over the top k logits), and its experts: stacked in the checkpoint, with biases and a
clamped SwiGLU. Once loaded each is a `gpt_oss.Expert` (two biased linear layers on the dense
kernels), never in the native call; `gpt_oss.grouped` runs every expert's gate/up, the
activation once on PyTorch's ops, then every expert's down.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.models import gpt_oss
from inferd.models.config import ArchConfig, MoEConfig
from inferd.models.kernels.decode_moe import MoEWeights
from inferd.models.kernels.fused import FusedOps, MoEKernel, MoEPanels
from inferd.models.kernels.gemv import Int8Weight, PanelWeight
from inferd.models.linear import ANY_ROWS, Linear
from inferd.models.weights import WeightTarget

# Checkpoint names of each expert's gate, up and down projections, per naming style.
_EXPERT_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


class StepRows(Protocol):
    """What the block reads of the layer's step (models/layers.py's Step)."""

    @property
    def rows(self) -> int: ...

    @property
    def fused(self) -> FusedOps | None: ...


class Expert(nn.Module):
    """One expert's gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(
        self, hidden: int, inter: int, names: tuple[str, str, str], dtype: torch.dtype
    ) -> None:
        super().__init__()
        gate, up, down = names
        self.gate_up_proj = Linear(hidden, [(gate, inter), (up, inter)], False, dtype)
        self.down_proj = Linear(inter, [(down, hidden)], False, dtype)

    def forward(self, x: Tensor, fused: FusedOps | None) -> Tensor:
        # x: [n, H] -> gate_up: [n, 2I] -> [n, H]
        n = x.shape[0]
        gate_up = self.gate_up_proj(x)
        if fused is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        # SiLU * up written padded to the rows the down GEMM runs (oneDNN's counts).
        return self.down_proj(fused.silu_mul(gate_up, self.down_proj.padded_rows(n)))[:n]


class SparseMoE(nn.Module):
    def __init__(self, cfg: ArchConfig, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = moe.num_experts, cfg.hidden_size, moe.intermediate_size
        self.num_experts, self.top_k, self.inter = e, moe.top_k, i
        self.norm_topk_prob = moe.norm_topk_prob
        self.spec = moe
        # The router's weight: checkpoint name `<block>.gate.weight` (gpt-oss: router.weight,
        # with a bias).
        self.router = nn.Parameter(torch.empty(e, h, dtype=dtype), False)
        self.router_bias: nn.Parameter | None = None
        # gpt-oss: stacked until loaded (`split_experts`), then gpt_oss.Expert each.
        self.experts: nn.ModuleList | gpt_oss.Experts
        if moe.style == "gpt_oss":
            self.router_bias = nn.Parameter(torch.empty(e, dtype=dtype), False)
            self.experts = gpt_oss.Experts(moe, h, dtype)
        else:
            names = _EXPERT_NAMES[moe.style]
            self.experts = nn.ModuleList(Expert(h, i, names, dtype) for _ in range(e))
        # Rows routed to each expert by the forwards since `take_counts` (step statistics).
        self.counts: list[int] = [0] * e

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k] int64), as HF's router."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        if self.spec.style == "gpt_oss":
            return gpt_oss.route(logits, self.top_k)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w /= top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_i

    def forward(self, step: StepRows, x: Tensor) -> Tensor:
        # x: [T', H] (T' >= step.rows; rows past T are padding) -> [T, H]
        return self.mix(x[: step.rows], step.fused)

    def mix(self, x: Tensor, fused: FusedOps | None = None) -> Tensor:
        """x [T, H] -> the experts' outputs summed with their routing weights, [T, H]; `fused`:
        the native kernels (the layer in one call where the experts' kernel takes their rows,
        else SiLU * up; None: PyTorch's ops)."""
        weights, experts = self.route(x)
        panels = None if fused is None else self.panels
        # The native call gives None where an expert received more rows than its kernel's route
        # takes, as some surely does past max_rows * E assignments (not tried then).
        most = 0 if panels is None else panels.max_rows * self.num_experts
        done = None
        if fused is not None and panels is not None and x.shape[0] * self.top_k <= most:
            done = fused.moe_layer(x, experts, weights, panels, self.inter)
        if done is not None:
            y, counts = done
            self._count(counts)
            return y
        flat = experts.flatten()  # [T * k]: assignment a is token a // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read
        self._count(counts)
        rows = order // self.top_k  # the token of each sorted assignment
        out = self._grouped(x.index_select(0, rows), counts, fused)  # [T * k, H]
        out *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, rows, out)

    def split_experts(self) -> None:
        """Once loaded: gpt-oss's stacked experts become one `gpt_oss.Expert` each."""
        if isinstance(self.experts, gpt_oss.Experts):
            self.experts = self.experts.split()

    def _count(self, counts: list[int]) -> None:
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]

    def _grouped(self, xs: Tensor, counts: list[int], fused: FusedOps | None) -> Tensor:
        """xs [T * k, H], grouped by expert (`counts[e]` rows each) -> each group through its
        expert, [T * k, H]: one GEMM per projection of each expert that received rows."""
        assert isinstance(self.experts, nn.ModuleList), "gpt-oss's experts are split once loaded"
        if self.spec.style == "gpt_oss":
            native = None
            if fused is not None and (panels := self.gpt_oss_panels) is not None:
                native = (fused, panels)
            return gpt_oss.grouped(self.experts, xs, counts, native)
        out = torch.empty_like(xs)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                out[start : start + n] = expert(xs[start : start + n], fused)
                start += n
        return out

    @cached_property
    def panels(self) -> MoEPanels | None:
        """The experts' copies the native call reads, where every expert's plan starts with the
        panel GEMM or the int8 GEMV; None where one starts with another kernel (oneDNN, dense).
        Read on the first fused forward, once prepare_linears has packed them."""
        if self.spec.style == "gpt_oss":
            return None  # the native call computes SiLU * up, without biases
        gate_up: list[int] = []
        down: list[int] = []
        most, kernels = ANY_ROWS, set[MoEKernel]()
        for expert in self._experts():
            for linear, ptrs in ((expert.gate_up_proj, gate_up), (expert.down_proj, down)):
                w = linear.gemv_weight()
                if w is None:
                    return None
                ptrs += _addresses(w.weight)
                kernels.add(w.kernel)
                most = min(most, linear.plan[0].max_rows)
        if len(kernels) != 1:  # some experts kept in float by an int8 checkpoint
            return None
        return MoEPanels(gate_up, down, most, kernels.pop())

    @cached_property
    def gpt_oss_panels(self) -> gpt_oss.ExpertPanels | None:
        """gpt-oss: every expert's panel copies (`gpt_oss.panels`), where each projection runs
        as one native call over all experts. Read on the first fused forward, as `panels`."""
        assert isinstance(self.experts, nn.ModuleList), "gpt-oss's experts are split once loaded"
        return gpt_oss.panels(self.experts)

    def decode_weights(self) -> MoEWeights | None:
        """This block as the one-call decode step runs it (kernels/decode.py): each expert on its
        plan's first kernel for as many rows as the step sends it (`Linear.gemv_weight`), or None
        where that kernel is not one of the step's."""
        panels = self.panels
        if panels is None:
            return None
        linears = [p for e in self._experts() for p in (e.gate_up_proj, e.down_proj)]
        rows = min(w.max_rows for p in linears if (w := p.gemv_weight()) is not None)
        return MoEWeights(self.route, replace(panels, max_rows=rows), self.top_k, self.inter)

    def _experts(self) -> list[Expert]:
        assert isinstance(self.experts, nn.ModuleList)
        experts = [e for e in self.experts if isinstance(e, Expert)]
        assert len(experts) == self.num_experts
        return experts

    def take_counts(self) -> list[int]:
        """Rows routed to each expert since the last call (and start counting again)."""
        counts, self.counts = self.counts, [0] * self.num_experts
        return counts

    def layout(self, name: str) -> dict[str, WeightTarget]:
        """The router's checkpoint tensor -> its target, `name` this block's (and the
        checkpoint's) name; the experts' Linear layers are laid out as any other's."""
        if self.spec.style == "gpt_oss":
            h, i, mxfp4 = self.router.shape[1], self.inter, self.spec.mxfp4
            return gpt_oss.expert_layout(name, self.num_experts, h, i, mxfp4)
        return {f"{name}.gate.weight": WeightTarget(f"{name}.router", 0, self.num_experts)}


def _addresses(w: PanelWeight | Int8Weight) -> list[int]:
    """The addresses moe_experts.cpp reads of an expert's copy (fused.MOE_ADDRESSES)."""
    if isinstance(w, PanelWeight):
        return [w.packed.data_ptr()]
    bias = 0 if w.bias is None else w.bias.data_ptr()
    return [w.q.data_ptr(), w.scale.data_ptr(), w.row_sum.data_ptr(), bias]
