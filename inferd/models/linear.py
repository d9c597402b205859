"""Which kernel multiplies a linear layer's batch, and which copies of its weight are held.

    y = x W^T + b        x: [T, in]   W: [out, in]   b: [out]   y: [T, out]

The loader fills each `Linear.weight` densely, in the model dtype. `prepare_linears` then gives
every layer its dispatch plan, `Linear.plan`: an ordered tuple of `Route(max_rows, kernel)`; a
batch of T rows runs the first route with T <= max_rows (the last takes any count). `forward`,
the one-call decode step (`gemv_weight`) and the memory accounting (`layout_bytes`) all read it.
The plan, by the layer's kind (`resolve_linear_kind`), dtype and CPU:

    kind     dtype / CPU                                plan (rows -> kernel)
    dense    CUDA, float16, --linear-backend dense      any -> dense
    onednn   float32; bfloat16 with AVX512_BF16         any -> panel          (native kernels)
             the same with --native-linear on           <=128 -> panel, any -> onednn
             bfloat16 without AVX512_BF16, odd `in`,    any -> onednn
             no native kernels, --native-linear off
    int8     AVX512-VNNI / AVX-VNNI                     <=2 -> gemv_int8, any -> int8
             the same with --native-linear off          any -> int8

The kernels, each on its own copy of the weight:
- `dense`: `F.linear` on the dense weight (cuBLAS on CUDA; the reference).
- `panel`: kernels/panel_gemm.cpp on the weight packed in panels of 64 output columns
  (`PanelWeight`), 128 rows a call (larger batches in 128-row slices). At 1-128 rows it beats
  oneDNN's GEMM (bench/NOTES.md); on AMX CPUs bfloat16 runs on its tiles.
- `onednn`: the weight reordered once into oneDNN's blocked layout, rows padded to a bounded set
  of counts (models/gemm.py). `F.linear` would re-pack it on every call.
- `int8`: fbgemm's dynamic int8 GEMM on a prepacked per-channel int8 copy (models/gemm.py).
- `gemv_int8`: kernels/gemv.cpp's int8 GEMV on a row-major int8 copy (`Int8Weight`).

The one-call decode step (kernels/decode.py) runs each layer's first kernel where it is one of
its own (panel, gemv_int8; else the model has no such step), for as many rows as one call takes
(`gemv_weight`): panel 128, gemv_int8 8; with no Python between the kernels its 3-8 rows beat
fbgemm (1.25-1.7x, docs/architecture.md), though not called from Python (`GEMV_MAX_ROWS`).

Each weight is held once: in the layout of the plan's first-layout kernel (panel, onednn, int8
or dense); the dense weight is freed unless another module reads it (tied embeddings read the
panel copy instead where they can, `PanelRows`). A second layout is kept with `--native-linear
on`; under `auto`, oneDNN's copy for prefill batches beside the panels only when the second
layouts together take at most a quarter of the weights' bytes (`SECOND_LAYOUT_SHARE`, the 1.25x
of docs/benchmarks.md's memory bound), and the int8 GEMV's copy beside fbgemm's always (the
one-call decode step reads it: a single stream without it ran at 0.42x).
`prepare_linears` logs the decision in one line with the bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.config import LinearBackend, NativeLinearMode, Quantization
from inferd.errors import ModelLoadError
from inferd.models.gemm import BF16_ROW_BUCKETS as BF16_ROW_BUCKETS
from inferd.models.gemm import ROW_BUCKETS as ROW_BUCKETS
from inferd.models.gemm import LinearFn, int8_gemm, onednn_gemm, row_buckets
from inferd.models.gemm import LinearKind as LinearKind
from inferd.models.gemm import has_int8_gemm as has_int8_gemm
from inferd.models.gemm import padded_rows as padded_rows
from inferd.models.gemm import quantize_int8 as quantize_int8
from inferd.models.kernels.decode import GemvWeight
from inferd.models.kernels.gemv import Gemv, Int8Weight, PanelWeight

logger = logging.getLogger("inferd.models")

KernelName = Literal["dense", "panel", "onednn", "int8", "gemv_int8"]
# A route's max_rows that takes any row count.
ANY_ROWS = 2**62
# The most rows the int8 GEMV takes in the plan (it measured no faster than fbgemm at four).
GEMV_MAX_ROWS = 2
# The kinds that run native kernels on a copy of their own (both pack their weights).
GEMV_KINDS = ("onednn", "int8")
# Second layouts are kept under `auto` while they take at most this share of the weights' bytes.
SECOND_LAYOUT_SHARE = 0.25
GIB = 2**30


@dataclass(frozen=True)
class Route:
    """Batches of up to `max_rows` rows (not taken by an earlier route) run `kernel`."""

    max_rows: int
    kernel: KernelName


Plan = tuple[Route, ...]


@dataclass(frozen=True)
class NativeLinear:
    """The native kernels the linear layers run (`native_linear` decides), and whether they
    keep the second layouts the plan adds."""

    gemv: Gemv
    second_layouts: bool


def plan_for(
    kind: LinearKind, dtype: torch.dtype, in_features: int, native: NativeLinear | None
) -> Plan:
    """The module docstring's table."""
    if kind == "dense":
        return (Route(ANY_ROWS, "dense"),)
    if native is None:
        return (Route(ANY_ROWS, kind),)
    if kind == "int8":
        if not native.second_layouts:
            return (Route(ANY_ROWS, "int8"),)
        return Route(GEMV_MAX_ROWS, "gemv_int8"), Route(ANY_ROWS, "int8")
    panel_rows = native.gemv.panel_rows.get(dtype, 0)
    if not (panel_rows and PanelWeight.padded_out((1, in_features), dtype)):
        return (Route(ANY_ROWS, "onednn"),)
    if native.second_layouts:
        return Route(panel_rows, "panel"), Route(ANY_ROWS, "onednn")
    return (Route(ANY_ROWS, "panel"),)


@runtime_checkable
class PanelRows(Protocol):
    """A module that shares a Linear's weight and can read its rows from the panel copy
    instead (models/layers.py's Embedding), so the dense weight can be freed."""

    def read_rows_from(self, panel: PanelWeight) -> None: ...


class LowRankRows(Protocol):
    """Whether the step being run has rows under a LoRA adapter (inferd/lora/layer.py)."""

    @property
    def active(self) -> bool: ...


class LowRankTerm(LowRankRows, Protocol):
    """What a linear layer adds to its output for the rows that run a LoRA adapter
    (inferd/lora/layer.py): nothing while `active` is False."""

    def add_to(self, x: Tensor, y: Tensor) -> None: ...


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` names the checkpoint tensors stacked along the output dim."""

    def __init__(
        self, in_features: int, shards: list[tuple[str, int]], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in shards)
        self.shards = shards
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype), False) if bias else None
        )
        self.kind: LinearKind = "dense"
        # Set by prepare(): the dispatch plan and each of its kernels over its copy.
        self.plan: Plan = (Route(ANY_ROWS, "dense"),)
        self._run: dict[KernelName, LinearFn] = {}
        self._panel: PanelWeight | None = None
        self._w8: Int8Weight | None = None
        # A checkpoint already quantized to int8 (models/quantized.py): its integers [out, in] and
        # per-channel scales [out, 1], filled by the loader (expect_int8) and taken by the int8
        # kind as they are; released by prepare(). None for a float checkpoint.
        self.qweight: nn.Parameter | None = None
        self.weight_scale: nn.Parameter | None = None
        # The int8 checkpoint stores this layer in float (its `ignore` list): it stays float.
        self.keep_float = False
        # LoRA adapters' term over their own rows, added after the base GEMM (inferd/lora).
        self.lora: LowRankTerm | None = None
        # The native kernels the plan's native routes call (set by prepare()).
        self._gemv: Gemv | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = self._base(x)
        if self.lora is not None and self.lora.active:
            self.lora.add_to(x, y)
        return y

    def route(self, rows: int) -> Route:
        """The route a batch of `rows` rows takes (an empty one: the last, which takes any)."""
        return next((r for r in self.plan if 0 < rows <= r.max_rows), self.plan[-1])

    def _base(self, x: Tensor) -> Tensor:
        route = self.route(x.shape[0])
        if route.kernel == "dense":
            return F.linear(x, self.weight, self.bias)
        return self._run[route.kernel](x)

    def expect_int8(self) -> None:
        """The checkpoint holds this layer as int8 weights and per-channel scales."""
        device = self.weight.device
        self.qweight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=torch.int8, device=device), False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(self.out_features, 1, dtype=torch.float32, device=device), False
        )

    def dequantize(self) -> None:
        """Fills the float weight from the loaded int8 one (W = q * scale), for every kernel
        but int8, which takes the integers themselves."""
        assert self.qweight is not None and self.weight_scale is not None
        with torch.no_grad():
            self.weight.copy_(self.qweight.float() * self.weight_scale)

    def prepare(
        self, kind: LinearKind, keep_dense: bool, native: NativeLinear | None = None
    ) -> None:
        """Gives the layer its plan (`plan_for`) and builds each of its kernels' copies; frees
        the dense weight unless `keep_dense` (another module reads it) or the plan runs it."""
        loaded = None
        if self.qweight is not None and self.weight_scale is not None:
            loaded = self.qweight.detach(), self.weight_scale.detach()[:, 0].contiguous()
            self.qweight = self.weight_scale = None
        self.kind = kind
        self.plan = plan_for(kind, self.weight.dtype, self.in_features, native)
        self._run, self._panel, self._w8 = {}, None, None
        self._gemv = None if native is None else native.gemv
        weight, bias = self.weight.detach(), self._bias_or_none()
        kernels = {r.kernel for r in self.plan}
        if kernels & {"int8", "gemv_int8"}:
            q, scale = loaded or quantize_int8(weight)
            if "int8" in kernels:
                self._run["int8"] = int8_gemm(q, scale, bias)
            if "gemv_int8" in kernels:
                assert native is not None
                self._w8 = w8 = Int8Weight.of(q, scale, bias)
                self._run["gemv_int8"] = lambda x: native.gemv.int8(x, w8)
        if "onednn" in kernels:
            self._run["onednn"] = onednn_gemm(weight, bias)
        if "panel" in kernels:
            assert native is not None
            self._panel = PanelWeight.of(weight, bias)
            assert self._panel is not None, "plan_for gives panels only to weights it takes"
            self._run["panel"] = _panel_gemm(native.gemv, self._panel)
        if not keep_dense and "dense" not in kernels:
            self.free_dense()

    def free_dense(self) -> None:
        """Drops the dense weight (its kernels read their own copies)."""
        self.weight = nn.Parameter(self.weight.detach().new_empty((0, self.in_features)), False)

    def _bias_or_none(self) -> Tensor | None:
        return None if self.bias is None else self.bias.detach()

    def padded_rows(self, rows: int) -> int:
        """The rows an input of `rows` rows is padded to before this layer multiplies (oneDNN's
        row counts, gemm.padded_rows; the native kernels take any count)."""
        if next(r for r in self.plan if rows <= r.max_rows).kernel != "onednn":
            return rows
        return padded_rows(self.kind, rows, self.weight.dtype)

    def panel_copy(self) -> PanelWeight | None:
        """The panel copy batches of up to `Gemv.panel_rows` rows run on, or None."""
        return self._panel

    def plain_weight(self) -> Tensor | None:
        """The dense row-major weight [out, in], where it is still held (shared, or kept)."""
        return self.weight.detach() if self.weight.shape[0] == self.out_features else None

    def gemv_weight(self) -> GemvWeight | None:
        """The one-call decode step's kernel and weight (the module docstring's rule); None
        when the plan's first kernel is not one of the step's."""
        first, gemv = self.plan[0].kernel, self._gemv
        if first == "panel" and self._panel is not None and gemv is not None:
            return GemvWeight("panel", self._panel, gemv.panel_rows[self._panel.packed.dtype])
        if first == "gemv_int8" and self._w8 is not None and gemv is not None:
            return GemvWeight("gemv_int8", self._w8, gemv.int8_max_rows)
        return None


def _panel_gemm(gemv: Gemv, panel: PanelWeight) -> LinearFn:
    """The panel GEMM over any row count: `panel_rows` rows a call, into one output."""
    step = gemv.panel_rows[panel.packed.dtype]

    def run(x: Tensor) -> Tensor:
        rows = x.shape[0]
        if 0 < rows <= step:
            return gemv.panel(x, panel)
        y = x.new_empty((rows, panel.out_features))
        for i in range(0, rows, step):
            gemv.panel(x[i : i + step], panel, y[i : i + step])
        return y

    return run


def prepare_linears(
    model: nn.Module,
    kind: LinearKind,
    native: NativeLinear | Gemv | None = None,
    float_kind: LinearKind = "dense",
) -> None:
    """Gives every Linear of `model` its plan for `kind` and builds its copies (the module
    docstring's rule), keeping dense weights other modules read. Under int8, a layer an int8
    checkpoint stores in float (`keep_float`) takes `float_kind`, the kind it would have had
    unquantized. A bare Gemv for `native` keeps the second layouts (as `--native-linear on`)."""
    if isinstance(native, Gemv):
        native = NativeLinear(native, second_layouts=True)
    shared = _shared_weights(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for m in linears:
        own = _own_kind(m, kind, float_kind)
        m.prepare(own, keep_dense=id(m.weight) in shared, native=native)
    tied = _read_tied_rows_from_panels(model, linears, shared)
    if onednn := [m for m in linears if "onednn" in {r.kernel for r in m.plan}]:
        _warm_up(onednn)
    if kind != "dense":
        logger.info("linear layers: %s", _decision(model, kind, float_kind, native, tied))


def _own_kind(m: Linear, kind: LinearKind, float_kind: LinearKind) -> LinearKind:
    return float_kind if kind == "int8" and m.keep_float else kind


def _read_tied_rows_from_panels(model: nn.Module, linears: list[Linear], shared: set[int]) -> int:
    """Tied embeddings read their rows from the Linear's panel copy, and the dense weight is
    freed, where every other module holding it can (PanelRows); returns how many were."""
    tied = 0
    for m in linears:
        panel = m.panel_copy()
        if id(m.weight) not in shared or panel is None or m.plan[-1].kernel == "dense":
            continue
        others = [
            o for o in model.modules() if o is not m and getattr(o, "weight", None) is m.weight
        ]
        readers = [o for o in others if isinstance(o, PanelRows)]
        if others and len(readers) == len(others):
            for o in readers:
                o.read_rows_from(panel)
            m.free_dense()
            tied += 1
    return tied


def _decision(
    model: nn.Module,
    kind: LinearKind,
    float_kind: LinearKind,
    native: NativeLinear | None,
    tied: int,
) -> str:
    """The start-up line: each layer's first layout, the second layouts and their bytes."""
    linears = _unique_linears(model)
    one = None if native is None else NativeLinear(native.gemv, second_layouts=False)
    first = sum(layout_bytes(m, _plan(m, kind, float_kind, one)) for m in linears)
    kernels = sorted({r.kernel for m in linears for r in m.plan})
    line = f"{len(linears)} as {'+'.join(kernels)}, each weight once: {first / GIB:.2f} GiB"
    extra, weights = second_layout_bytes(model, kind, float_kind, native), weight_bytes(model, kind)
    if native is not None and native.second_layouts and extra:
        line += f", second layouts kept: +{extra / GIB:.2f} GiB"
    elif native is not None and extra:
        line += (
            f", second layouts not kept (+{extra / GIB:.2f} GiB, over {SECOND_LAYOUT_SHARE:.0%}"
            f" of the {weights / GIB:.2f} GiB of weights; --native-linear on keeps them)"
        )
    if tied:
        line += "; tied embeddings read the lm_head's panel copy"
    return line


def layout_bytes(m: Linear, plan: Plan) -> int:
    """Bytes of the copies of `m`'s weight that `plan`'s kernels read."""
    n, k, dtype = m.out_features, m.in_features, m.weight.dtype
    size = dtype.itemsize
    total = 0
    for kernel in {r.kernel for r in plan}:
        if kernel == "panel":
            total += PanelWeight.padded_out((n, k), dtype) * k * size
        elif kernel in ("int8", "gemv_int8"):
            total += n * k
        else:
            total += n * k * size
    return total


def second_layout_bytes(
    model: nn.Module, kind: LinearKind, float_kind: LinearKind, native: NativeLinear | None
) -> int:
    """Bytes the plans' second layouts add over each weight's first one."""
    if native is None:
        return 0
    one, two = (NativeLinear(native.gemv, second_layouts=s) for s in (False, True))
    return sum(
        layout_bytes(m, _plan(m, kind, float_kind, two))
        - layout_bytes(m, _plan(m, kind, float_kind, one))
        for m in _unique_linears(model)
    )


def weight_bytes(model: nn.Module, kind: LinearKind) -> int:
    """The model's weights at the served precision: every parameter at its dtype's size, but
    linear weights at a byte under int8 (those an int8 checkpoint keeps in float excepted)."""
    linear_ids = {}
    for m in model.modules():
        if isinstance(m, Linear):
            int8 = kind == "int8" and not m.keep_float
            size = 1 if int8 else m.weight.dtype.itemsize
            linear_ids[id(m.weight)] = m.out_features * m.in_features * size
    total = sum(linear_ids.values())
    for p in model.parameters():
        if id(p) not in linear_ids:
            total += p.numel() * p.element_size()
    return total


def _plan(m: Linear, kind: LinearKind, float_kind: LinearKind, native: NativeLinear | None) -> Plan:
    own = _own_kind(m, kind, float_kind)
    return plan_for(own, m.weight.dtype, m.in_features, native if own in GEMV_KINDS else None)


def _unique_linears(model: nn.Module) -> list[Linear]:
    return list({id(m.weight): m for m in model.modules() if isinstance(m, Linear)}.values())


def native_linear(
    mode: NativeLinearMode,
    kind: LinearKind,
    gemv: Gemv | None,
    model: nn.Module,
    float_kind: LinearKind = "dense",
) -> NativeLinear | None:
    """The native kernels the linear layers of `model` run (`--native-linear`), or None.

    `gemv` is the loaded library's (None where the native kernels do not run here: `on` is then
    an error, `auto` falls back quietly). Second layouts: `on` keeps them, `auto` while they take
    at most SECOND_LAYOUT_SHARE of the weights' bytes, and int8's always."""
    if mode == "off" or kind not in GEMV_KINDS:
        return None
    if gemv is None:
        if mode == "on":
            raise ModelLoadError("--native-linear on needs the native CPU kernels")
        return None
    if mode == "on" or kind == "int8":
        # int8 keeps its GEMV copy: the one-call decode step reads it, and without it a single
        # stream ran at 0.42x (bench/NOTES.md); int8 weights are a byte each, so both copies
        # together still take less than one float32 copy.
        return NativeLinear(gemv, second_layouts=True)
    extra = second_layout_bytes(model, kind, float_kind, NativeLinear(gemv, False))
    return NativeLinear(gemv, extra <= SECOND_LAYOUT_SHARE * weight_bytes(model, kind))


def resolve_linear_kind(
    backend: LinearBackend,
    quantization: Quantization | None,
    device: torch.device,
    dtype: torch.dtype,
) -> LinearKind:
    """The kernel every Linear of a model runs: int8 when asked, else oneDNN on CPU if it can."""
    cpu = device.type == "cpu"
    if quantization == "int8":
        if not cpu or not has_int8_gemm():
            raise ModelLoadError(
                "--quantization int8 needs a CPU with AVX512-VNNI or AVX-VNNI (int8 dot products)"
            )
        return "int8"
    mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    onednn_ok = cpu and mkldnn and dtype != torch.float16
    if backend == "onednn" and not onednn_ok:
        raise ModelLoadError(
            "--linear-backend onednn needs a CPU device and PyTorch built with oneDNN"
        )
    if backend == "dense" or not onednn_ok:
        return "dense"
    return "onednn"


def checkpoint_quantization(device: torch.device) -> Quantization | None:
    """What an int8 checkpoint (models/quantized.py) runs as when no --quantization is given:
    int8 where the int8 kernels run (a CPU with VNNI), else its weights dequantized."""
    if device.type == "cpu" and has_int8_gemm():
        return "int8"
    logger.info("int8 checkpoint: no int8 kernels on %s, running it dequantized", device)
    return None


@torch.inference_mode()
def _warm_up(linears: list[Linear]) -> None:
    """Runs each distinct weight shape once per row bucket, so oneDNN's per-shape primitives are
    built now rather than during serving (layers of one shape share them). Row counts the plan
    sends elsewhere never reach oneDNN and are skipped."""
    shapes = {(m.in_features, m.out_features, m.bias is not None): m for m in linears}
    for m in shapes.values():
        for rows in row_buckets(m.weight.dtype):
            if m.route(rows).kernel == "onednn":
                m(torch.zeros(rows, m.in_features, dtype=m.weight.dtype))


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied lm_head / embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}
