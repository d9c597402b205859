"""gpt-oss's mixture-of-experts pieces (`GptOssForCausalLM`), used by models/moe.py's SparseMoE.

Its experts load in the checkpoint's stacked form (`Experts`: one gate/up and one down matrix per
expert, with biases), then each becomes two `Linear` layers with their biases (`Expert`), which
take the dense layers' kernels; the clamped SwiGLU between them runs on PyTorch's ops.

- **Routing**: router logits with a bias, the top k of the logits, then a softmax over those k
  (in the logits' dtype, as transformers does).
- **Clamped SwiGLU**: gate clamped to at most `limit`, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate).
- **Checkpoint layout**: the experts of a layer are two stacked tensors, `experts.gate_up_proj`
  [E, H, 2I] (input-major: x @ W) whose columns interleave gate and up (gate 2j, up 2j + 1), and
  `experts.down_proj` [E, I, H], each with a bias (`gate_up_proj_bias` [E, 2I], `down_proj_bias`
  [E, H]); the router is `router.weight` [E, H] and `router.bias` [E]. They are turned into
  `Experts`' rows at load: transposed to [out, in], gate rows before up rows.
- **MXFP4** (the Hub's checkpoints, `quantization_config.quant_method: mxfp4`): each expert
  matrix as `<name>_blocks` [E, out, in / 32, 16] uint8, two 4-bit E2M1 values a byte (low
  nibble first), and `<name>_scales` [E, out, in / 32] uint8, one E8M0 exponent per 32 values
  (2^(s - 127)). Dequantized to the serving dtype at load (`dequantize_mxfp4`; transformers'
  `convert_moe_packed_tensors` reads the same bytes, tests compare the two), already [out, in].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from inferd.models.config import MoEConfig
from inferd.models.kernels.fused import FusedOps, PanelCopy
from inferd.models.kernels.gemv import PanelWeight
from inferd.models.linear import Linear
from inferd.models.weights import Convert, WeightTarget

# The 16 values of an E2M1 nibble: sign bit 3, then 2 exponent bits and 1 mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype`; one
    leading index at a time, so the float32 copy stays one expert's size."""
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=dtype)
    for e in range(blocks.shape[0]):
        b = blocks[e].to(torch.int64)
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
        exponents = scales[e].to(torch.int32).unsqueeze(-1) - 127
        out[e] = torch.ldexp(values, exponents).flatten(-2).to(dtype)
    return out


class Experts(nn.Module):
    """One layer's experts as the checkpoint stacks them, for loading: `w13` [E * 2I, H] (each
    expert's gate rows, then its up rows), `w2` [E * H, I], biases `b13` [E * 2I] and `b2`
    [E * H]. Once loaded, `split` turns them into one `Expert` each."""

    def __init__(self, moe: MoEConfig, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.spec = moe
        self.w13 = nn.Parameter(torch.empty(e * 2 * i, hidden, dtype=dtype), False)
        self.w2 = nn.Parameter(torch.empty(e * hidden, i, dtype=dtype), False)
        self.b13 = nn.Parameter(torch.empty(e * 2 * i, dtype=dtype), False)
        self.b2 = nn.Parameter(torch.empty(e * hidden, dtype=dtype), False)

    def split(self) -> nn.ModuleList:
        """The experts as `Expert`s, each holding a copy of its rows; the stacked tensors are
        released as they are copied, one layer's at a time beside the loaded model."""
        e, hidden = self.spec.num_experts, self.w13.shape[1]
        w13, w2 = self.w13.view(e, -1, hidden), self.w2.view(e, hidden, -1)
        b13, b2 = self.b13.view(e, -1), self.b2.view(e, -1)
        with torch.no_grad(), torch.device(self.w13.device):
            experts = nn.ModuleList(
                Expert(w13[x], b13[x], w2[x], b2[x], self.spec) for x in range(e)
            )
        del self.w13, self.w2, self.b13, self.b2
        return experts


class Expert(nn.Module):
    """One expert: gate/up (gate rows, then up rows) and down, each a `Linear` with its bias, so
    `prepare_linears` gives them the dense layers' kernels (`grouped` runs them, the clamped
    SwiGLU between them on PyTorch's ops)."""

    def __init__(self, w13: Tensor, b13: Tensor, w2: Tensor, b2: Tensor, spec: MoEConfig) -> None:
        super().__init__()
        self.spec = spec
        hidden, inter = w2.shape
        self.gate_up_proj = Linear(hidden, [("gate_up_proj", 2 * inter)], True, w13.dtype)
        self.down_proj = Linear(inter, [("down_proj", hidden)], True, w2.dtype)
        for linear, w, b in ((self.gate_up_proj, w13, b13), (self.down_proj, w2, b2)):
            linear.weight.copy_(w)
            assert linear.bias is not None
            linear.bias.copy_(b)


ExpertPanels = tuple[list[PanelCopy], list[PanelCopy]]


def grouped(
    experts: nn.ModuleList,
    xs: Tensor,
    counts: list[int],
    native: tuple[FusedOps, ExpertPanels] | None = None,
) -> Tensor:
    """xs [T * k, H] grouped by expert (`counts[e]` rows each) -> each group through its
    `Expert`, [T * k, H]: every expert's gate/up GEMM, the clamped SwiGLU once over all rows
    (elementwise, so each row's values are what one expert at a time gives), then every
    expert's down GEMM. With `native` (the fused ops and every expert's panel copies, `panels`),
    each projection is one native call over all experts (`FusedOps.grouped_panels`, the same
    values as the per-expert calls)."""
    members = [e for e in experts if isinstance(e, Expert)]
    assert len(members) == len(counts), "one Expert a count"
    spec = members[0].spec
    if native is not None:
        fused, (gate_up_panels, down_panels) = native
        gate, up = fused.grouped_panels(xs.contiguous(), counts, gate_up_panels).chunk(2, dim=-1)
        act = clamped_swiglu(gate, up, spec.swiglu_alpha, spec.swiglu_limit)
        return fused.grouped_panels(act, counts, down_panels)
    gate_up = xs.new_empty(xs.shape[0], 2 * members[0].down_proj.in_features)
    spans = []
    start = 0
    for expert, n in zip(members, counts, strict=True):
        if n:
            sl = slice(start, start + n)
            gate_up[sl] = expert.gate_up_proj(xs[sl])
            spans.append((expert, sl))
            start += n
    gate, up = gate_up.chunk(2, dim=-1)
    act = clamped_swiglu(gate, up, spec.swiglu_alpha, spec.swiglu_limit)
    out = torch.empty_like(xs)
    for expert, sl in spans:
        out[sl] = expert.down_proj(act[sl])
    return out


def panels(experts: nn.ModuleList) -> ExpertPanels | None:
    """Every expert's gate/up and down panel copies, where each layer's plan is the panel GEMM
    at every row count (float32, bfloat16); else None."""
    out: ExpertPanels = ([], [])
    for expert in experts:
        assert isinstance(expert, Expert)
        for linear, into in ((expert.gate_up_proj, out[0]), (expert.down_proj, out[1])):
            w = linear.gemv_weight()
            if len(linear.plan) != 1 or w is None or not isinstance(w.weight, PanelWeight):
                return None
            into.append(w.weight)
    return out


def route(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] (bias added) -> (weights [T, k], experts [T, k])."""
    top_v, top_i = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top_v, dim=-1, dtype=top_v.dtype), top_i


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _gate_rows_first(t: Tensor) -> Tensor:
    """[E, 2I, ...] with gate and up interleaved along dim 1 -> gate rows, then up rows, with
    the experts stacked: [E * 2I, ...]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).flatten(0, 1)


def _w13(parts: list[Tensor]) -> Tensor:  # gate_up_proj [E, H, 2I] -> [E * 2I, H]
    return _gate_rows_first(parts[0].transpose(1, 2))


def _w2(parts: list[Tensor]) -> Tensor:  # down_proj [E, I, H] -> [E * H, I]
    return parts[0].transpose(1, 2).flatten(0, 1)


def _b13(parts: list[Tensor]) -> Tensor:  # gate_up_proj_bias [E, 2I] -> [E * 2I]
    return _gate_rows_first(parts[0])


def _b2(parts: list[Tensor]) -> Tensor:  # down_proj_bias [E, H] -> [E * H]
    return parts[0].flatten()


def _mxfp4_w13(parts: list[Tensor]) -> Tensor:  # [E, 2I, H / 32, 16] + scales -> [E * 2I, H]
    # bfloat16 holds every E2M1 value times a power of two exactly: no rounding, half the bytes.
    return _gate_rows_first(dequantize_mxfp4(parts[0], parts[1], torch.bfloat16))


def _mxfp4_w2(parts: list[Tensor]) -> Tensor:  # [E, H, I / 32, 16] + scales -> [E * H, I]
    return dequantize_mxfp4(parts[0], parts[1], torch.bfloat16).flatten(0, 1)


def expert_layout(
    prefix: str, num_experts: int, hidden: int, inter: int, mxfp4: bool
) -> dict[str, WeightTarget]:
    """Checkpoint tensor name -> target for one layer's router and experts: `prefix` the block's
    name, in the checkpoint (`model.layers.0.mlp`) and in the model (SparseMoE's `router`,
    `router_bias`, and its `Experts`' stacked `w13`, `w2`, `b13`, `b2`)."""
    e, experts = num_experts, f"{prefix}.experts"
    out = {
        f"{prefix}.router.weight": WeightTarget(f"{prefix}.router", 0, e),
        f"{prefix}.router.bias": WeightTarget(f"{prefix}.router_bias", 0, e),
    }
    w13, w2 = f"{experts}.gate_up_proj", f"{experts}.down_proj"
    w13_names = (f"{w13}_blocks", f"{w13}_scales") if mxfp4 else (w13,)
    w2_names = (f"{w2}_blocks", f"{w2}_scales") if mxfp4 else (w2,)
    converts = [
        (Convert((f"{w13}_bias",), _b13), "b13", e * 2 * inter),
        (Convert((f"{w2}_bias",), _b2), "b2", e * hidden),
        (Convert(w13_names, _mxfp4_w13 if mxfp4 else _w13), "w13", e * 2 * inter),
        (Convert(w2_names, _mxfp4_w2 if mxfp4 else _w2), "w2", e * hidden),
    ]
    for convert, param, rows in converts:
        for name in convert.names:
            out[name] = WeightTarget(f"{experts}.{param}", 0, rows, convert)
    return out
