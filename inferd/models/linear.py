"""How a linear layer multiplies, decided once after its weights are loaded.

    y = x W^T + b        x: [T, in]   W: [out, in]   b: [out]   y: [T, out]

The loader fills each `Linear.weight` densely, in the model dtype. `prepare_linears(model, kind)`
then turns every weight into the form the chosen kernel reads, once:

- `dense`: `F.linear` on the dense weight. CUDA (cuBLAS needs nothing more), and the fallback.
- `onednn`: the weight reordered once into oneDNN's blocked layout (CPU, float32 or bfloat16).
  `F.linear` re-packs panels of the weight on every call; prepacked, the same GEMM is 1.5-2.6x
  faster on decode-sized batches (docs/benchmarks.md), as vLLM's CPU backend and inductor find.
- `int8`: weights quantized to int8 with one symmetric scale per output channel, prepacked for
  fbgemm; activations are quantized to 8 bits per call from their own range (dynamic), and the
  dot products run on integer units (AVX512-VNNI where present). Like llama.cpp's Q8_0, which also
  quantizes activations, this trades a small, stated logit error for 4x fewer weight bytes.

Only the kernel's own copy of the weight is kept: the dense `weight` parameter is freed (an empty
tensor of the same dtype) unless another module shares it (tied embeddings), or unless the native
GEMV serves the few-row batches:

- small-batch GEMV (`onednn` and `int8`, `DeviceConfig.small_batch_gemv`): batches of at most
  `GEMV_MAX_ROWS` rows (a single stream's decode step, two streams) run the native kernel of
  `kernels/gemv.cpp` on a plain row-major weight, which streams it from memory faster than
  oneDNN's GEMM on the packed one (1.1-1.25x at one or two rows; docs/benchmarks.md). Where the
  panel GEMM below is built, it takes these rows too.
  It needs the plain weight kept beside the packed one: one more copy of every linear weight (for
  `int8` an int8 copy, a byte per weight; the kernel quantizes the rows of x from their own range,
  as fbgemm's dynamic GEMM does, and runs the dot products on VNNI). `auto` keeps it when that copy
  is at most a quarter of the machine's memory.
- panel GEMM (`onednn` float32 and bfloat16 weights with the small-batch GEMV; bfloat16 where
  the CPU has AVX512_BF16): batches of up to `Gemv.panel_rows` (128) rows, the GEMV's included,
  run `kernels/panel_gemm.cpp` on a copy of the weight packed in panels of 64 output columns,
  each thread streaming its own range of them; on AMX CPUs bfloat16 runs on its tiles
  (kernels/amx.h). It beats the GEMV and oneDNN's GEMM at every row count it takes
  (docs/benchmarks.md), so it takes them all, and the plain weight is then freed (unless
  shared): two copies in all, oneDNN's and the panels. The panel copy counts toward `auto`'s
  quarter of memory.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from inferd.config import LinearBackend, Quantization, SmallBatchGemv
from inferd.errors import ModelLoadError
from inferd.models.kernels.decode import GemvWeight
from inferd.models.kernels.gemv import Gemv, Int8Weight, PanelWeight

logger = logging.getLogger("inferd.models")

LinearKind = Literal["dense", "onednn", "int8"]
LinearFn = Callable[[Tensor], Tensor]


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
        # Set by prepare(); None: F.linear on the dense weight.
        self._fn: LinearFn | None = None
        # Set by use_gemv(): batches of at most `_gemv_rows` rows on the kept plain weight.
        self._gemv: Gemv | None = None
        self._gemv_rows = 0
        # Set by use_gemv() for float32 and bfloat16 (on AVX512_BF16) weights: batches of up to
        # `_panel_rows` rows (all the GEMV's and more) on the weight packed in panels (built on
        # first use, kept across use_gemv calls).
        self._panel: PanelWeight | None = None
        self._panel_rows = 0
        # The int8 kind's plain weight for the GEMV (prepare(..., keep_plain=True)).
        self._w8: Int8Weight | None = None
        # prepare(keep_dense=True): another module shares the dense weight, never freed here.
        self._weight_shared = False
        # A checkpoint already quantized to int8 (models/quantized.py): its integers [out, in] and
        # per-channel scales [out, 1], filled by the loader (expect_int8) and taken by the int8
        # kind as they are; released by prepare(). None for a float checkpoint.
        self.qweight: nn.Parameter | None = None
        self.weight_scale: nn.Parameter | None = None
        # The int8 checkpoint stores this layer in float (its `ignore` list): it stays float.
        self.keep_float = False
        # LoRA adapters' term over their own rows, added after the base GEMM (inferd/lora).
        self.lora: LowRankTerm | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = self._base(x)
        if self.lora is not None and self.lora.active:
            self.lora.add_to(x, y)
        return y

    def _base(self, x: Tensor) -> Tensor:
        if self._panel is not None and 0 < x.shape[0] <= self._panel_rows:
            assert self._gemv is not None
            return self._gemv.panel(x, self._panel)
        if self._gemv is not None and 0 < x.shape[0] <= self._gemv_rows:
            if self._w8 is not None:
                return self._gemv.int8(x, self._w8)
            return self._gemv(x, self.weight, self.bias)
        if self._fn is None:
            return F.linear(x, self.weight, self.bias)
        return self._fn(x)

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

    def prepare(self, kind: LinearKind, keep_dense: bool, keep_plain: bool = False) -> None:
        """Builds the kernel's copy of the weight; frees the dense one unless `keep_dense`.
        `keep_plain`: also keep the plain weight the small-batch GEMV reads (the dense one for
        `onednn`, an int8 row-major copy for `int8`)."""
        self._gemv = None
        self._w8 = None
        self._panel, self._panel_rows = None, 0
        self._weight_shared = keep_dense
        loaded = None
        if self.qweight is not None and self.weight_scale is not None:
            loaded = self.qweight.detach(), self.weight_scale.detach()[:, 0].contiguous()
            self.qweight = self.weight_scale = None
        if kind == "dense":
            self._fn, self.kind = None, kind
            return
        weight = self.weight.detach()
        bias = self._bias_or_none()
        if kind == "int8":
            q, scale = loaded or quantize_int8(weight)
            self._fn = _int8(q, scale, bias)
            if keep_plain:
                self._w8 = Int8Weight.of(q, scale, bias)
        else:
            self._fn = _onednn(weight, bias)
            keep_dense = keep_dense or keep_plain
        self.kind = kind
        if not keep_dense:
            self._free_dense()

    def _free_dense(self) -> None:
        self.weight = nn.Parameter(self.weight.detach().new_empty((0, self.in_features)), False)

    @property
    def _has_plain(self) -> bool:
        """Whether the dense weight is still held (not freed by prepare or use_gemv)."""
        return self.weight.shape[0] == self.out_features

    def _bias_or_none(self) -> Tensor | None:
        return None if self.bias is None else self.bias.detach()

    def use_gemv(self, gemv: Gemv | None) -> None:
        """Few-row batches on `gemv` (None: on the prepared kernel). Needs the plain weight kept
        (prepare(kind, ..., keep_plain=True)); once the panel copy takes every row count the GEMV
        would, the plain weight is freed (unless shared) and the panel copy stands in for it."""
        if self.kind == "int8":
            plain = self._w8 is not None
        else:
            plain = self._has_plain or self._panel is not None
        if gemv is not None and not plain:
            raise ValueError("use_gemv needs the plain weight: prepare(kind, ..., keep_plain=True)")
        self._gemv = gemv
        self._gemv_rows = 0 if gemv is None else GEMV_MAX_ROWS
        self._panel_rows = 0
        if gemv is None or self._w8 is not None:
            return
        if self.weight.dtype == torch.bfloat16:
            # bfloat16 on dot products: faster than oneDNN's GEMM up to bf16_dot_rows rows.
            self._gemv_rows = max(GEMV_MAX_ROWS, gemv.bf16_dot_rows)
        # The panel GEMM, where the CPU has it for this dtype, beats both at every row count it
        # takes (1-128; bench/gemv_rows.py, docs/benchmarks.md), so it takes all of them.
        panel_rows = gemv.panel_rows.get(self.weight.dtype, 0)
        if panel_rows and self.kind == "onednn":
            if self._panel is None:
                self._panel = PanelWeight.of(self.weight.detach(), self._bias_or_none())
            self._panel_rows = panel_rows if self._panel is not None else 0
        if not self._has_plain and self._panel_rows < self._gemv_rows:
            raise ValueError("the plain weight was freed for a panel copy this GEMV does not run")
        if self._panel_rows >= self._gemv_rows and not self._weight_shared:
            # Every row count the GEMV would take runs on the panel copy: the plain weight, a
            # third copy beside oneDNN's and the panels, would only take memory.
            self._free_dense()

    def padded_rows(self, rows: int) -> int:
        """The rows an input of `rows` rows is padded to before this layer multiplies (the module
        function below; the GEMV takes any count it takes)."""
        if self._gemv is not None and rows <= max(self._gemv_rows, self._panel_rows):
            return rows
        return padded_rows(self.kind, rows, self.weight.dtype)

    def panel_copy(self) -> PanelWeight | None:
        """The panel copy batches of up to `Gemv.panel_rows` rows run on, or None."""
        return self._panel if self._panel_rows else None

    def plain_weight(self) -> Tensor | None:
        """The dense row-major weight [out, in], where it is still held (shared, or kept)."""
        return self.weight.detach() if self._has_plain else None

    def gemv_weight(self) -> GemvWeight | None:
        """The plain weight few-row batches run the GEMV on; None when they do not."""
        if self._gemv is None:
            return None
        if self._w8 is not None:
            return GemvWeight(self._w8, None)
        return GemvWeight(self.plain_weight(), self.bias, self.panel_copy())


# oneDNN builds (JIT-compiles) a primitive per input shape and caches it. Most shapes cost little,
# but some row counts cost ~12 MiB each here (measured: 270 odd counts from 129 to 2048 grew the
# process by 3.2 GiB), so a server that met every count up to max_num_batched_tokens would grow by
# GBs. Rows are therefore padded to a bounded set of counts: up to 128, one of `row_buckets(dtype)`;
# above, the next multiple of 128 (measured: those 31 counts to 4096 together 32 MiB for one weight
# shape), in chunks of at most _ONEDNN_CHUNK rows. `warm_up` builds the small buckets at start
# (decode steps meet them all within seconds); the large ones are built on first use, a few ms.
# One call over all rows instead of 128-row chunks and a concatenation: 26.3 vs 28.6 ms at 2048
# rows of the tiny model's gate/up projection (2 threads).
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
# bfloat16 GEMMs take time in proportion to their rows from ~8 rows up (AVX512_BF16 dot products
# make them compute-bound sooner): padding 17 rows to 24 cost the Qwen2-0.5B shape's decode layers
# 12-25 % (2 threads). The finer counts below 64 run its 32-request mix 2-7 % faster offline,
# llama-32m's 1-2 %, for 13-58 MiB more of oneDNN primitives. float32 keeps the coarser set: the
# finer one measured 3-6 % slower on llama-32m (docs/benchmarks.md, "Finer row counts for
# bfloat16 oneDNN GEMMs").
BF16_ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
# The most rows the small-batch GEMV takes (it measured no faster than oneDNN at four); bfloat16
# weights more where the CPU has AVX512_BF16 (Gemv.bf16_dot_rows).
GEMV_MAX_ROWS = 2
# The kinds whose few-row batches the GEMV takes (both pack their weights for their own GEMM).
GEMV_KINDS = ("onednn", "int8")
_LARGE_STEP = 128
_ONEDNN_CHUNK = 2048


def row_buckets(dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts up to 128 that oneDNN GEMMs of weights in `dtype` run."""
    return BF16_ROW_BUCKETS if dtype == torch.bfloat16 else ROW_BUCKETS


def _row_bucket(rows: int, buckets: tuple[int, ...]) -> int:
    if rows > buckets[-1]:
        return -(-rows // _LARGE_STEP) * _LARGE_STEP
    return next(b for b in buckets if b >= rows)


def padded_rows(kind: LinearKind, rows: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows an input of `rows` rows is padded to before this kind's GEMM on `dtype` weights (if
    it fits one chunk).

    A caller that produces its activations with this many rows (extra rows zeroed) saves the
    linear layer its pad copy; it slices the first `rows` rows of the result."""
    if kind != "onednn" or rows > _ONEDNN_CHUNK:
        return rows
    return _row_bucket(rows, row_buckets(dtype))


def _onednn(weight: Tensor, bias: Tensor | None) -> LinearFn:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    op = torch.ops.mkldnn._linear_pointwise.default
    out_features = weight.shape[0]
    buckets = row_buckets(weight.dtype)

    def chunk(x: Tensor) -> Tensor:
        rows = x.shape[0]
        pad = _row_bucket(rows, buckets) - rows
        if pad == 0:
            return op(x, packed, bias, "none", [], "")
        return op(F.pad(x, (0, 0, 0, pad)), packed, bias, "none", [], "")[:rows]

    def run(x: Tensor) -> Tensor:
        rows = x.shape[0]
        if rows <= _ONEDNN_CHUNK:
            return chunk(x) if rows else x.new_empty((0, out_features))
        return torch.cat([chunk(x[i : i + _ONEDNN_CHUNK]) for i in range(0, rows, _ONEDNN_CHUNK)])

    return run


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(q int8 [out, in], scale float32 [out]): a symmetric scale per output row, W ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _int8(q: Tensor, scale: Tensor, bias: Tensor | None) -> LinearFn:
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # Quantized tensors are deprecated as a user-facing type; fbgemm's prepacked linear is
        # still the fastest int8 GEMM reachable from PyTorch on CPU, and this is its input.
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.float())
    op = torch.ops.quantized.linear_dynamic.default
    out_features = q.shape[0]

    def run(x: Tensor) -> Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, out_features))
        # reduce_range=False: 8-bit activations. Safe from int16 saturation only with VNNI's
        # int32 accumulation, which `resolve_linear_kind` checks before choosing int8.
        return op(x.float(), packed, False).to(x.dtype)

    return run


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


def has_int8_gemm() -> bool:
    """Whether this CPU has VNNI (int8 dot products accumulated in int32)."""
    if "VNNI" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_vnni" in flags or " avx_vnni" in flags


def prepare_linears(
    model: nn.Module,
    kind: LinearKind,
    gemv: Gemv | None = None,
    float_kind: LinearKind = "dense",
) -> None:
    """Converts every Linear of `model` to `kind`, keeping dense weights other modules share;
    with `gemv` (for the kinds in GEMV_KINDS), few-row batches run it on every layer's plain
    weight, all kept (Linear.prepare's `keep_plain`). Under int8, a layer an int8 checkpoint
    stores in float (`keep_float`) takes `float_kind`, the kind it would have had unquantized."""
    shared = _shared_weights(model)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    gemv = gemv if kind in GEMV_KINDS else None
    for m in linears:
        own = float_kind if kind == "int8" and m.keep_float else kind
        m_gemv = gemv if own in GEMV_KINDS else None
        m.prepare(own, keep_dense=id(m.weight) in shared, keep_plain=m_gemv is not None)
        m.use_gemv(m_gemv)
    if onednn := [m for m in linears if m.kind == "onednn"]:
        _warm_up(onednn)
    if kind != "dense":
        plain = "int8 copies" if kind == "int8" else "dense weights"
        extra = f" (+ the small-batch GEMV on the {plain})" if gemv is not None else ""
        logger.info("linear layers: %d prepared as %s%s", len(linears), kind, extra)


def small_batch_gemv(
    mode: SmallBatchGemv, kind: LinearKind, gemv: Gemv | None, model: nn.Module
) -> Gemv | None:
    """The GEMV the linear layers of `model` should use for few-row batches, or None.

    `gemv` is the loaded native kernel (None when the kernels do not run here). Only the kinds
    that pack their weights (oneDNN, int8) gain from a second copy (panels, or a plain one);
    `auto` keeps the copies when they take at most a quarter of physical memory, `on` always (an
    error without the kernels)."""
    if mode == "off" or kind not in GEMV_KINDS:
        return None
    if gemv is None:
        if mode == "on":
            raise ModelLoadError("--small-batch-gemv on needs the native CPU kernels")
        return None
    extra = plain_copy_bytes(model, kind, gemv)
    if kind == "onednn":  # int8 layers keep no panel copy
        extra += panel_copy_bytes(model, gemv)
    limit = _physical_memory_bytes() // 4
    if mode == "auto" and extra > limit:
        logger.info(
            "small-batch GEMV off: its weight copies (%.0f MiB) exceed a quarter of RAM",
            extra / 2**20,
        )
        return None
    return gemv


def plain_copy_bytes(
    model: nn.Module, kind: LinearKind = "onednn", gemv: Gemv | None = None
) -> int:
    """Bytes the small-batch GEMV's plain weights add: for `onednn` the dense weights that would
    otherwise be freed (but for dtypes `gemv` has the panel GEMM for, whose panel copies stand in
    for them), for `int8` an int8 copy of every weight."""
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)}
    if kind == "int8":
        return sum(m.weight.numel() for m in linears.values())
    shared = _shared_weights(model)
    return sum(
        m.weight.numel() * m.weight.element_size()
        for k, m in linears.items()
        if k not in shared and not (gemv and _panel_bytes(m, gemv))
    )


def panel_copy_bytes(model: nn.Module, gemv: Gemv) -> int:
    """Bytes the panel GEMM's packed copies add: every linear weight of a dtype it takes here
    once more."""
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)}
    return sum(_panel_bytes(m, gemv) for m in linears.values())


def _panel_bytes(m: Linear, gemv: Gemv) -> int:
    """Bytes of `m`'s panel copy; 0 when it gets none here (and keeps its plain weight)."""
    dtype = m.weight.dtype
    if not gemv.panel_rows.get(dtype, 0):
        return 0
    n_pad = PanelWeight.padded_out((m.out_features, m.in_features), dtype)
    return n_pad * m.in_features * m.weight.element_size()


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@torch.inference_mode()
def _warm_up(linears: list[Linear]) -> None:
    """Runs each distinct weight shape once per row bucket, so oneDNN's per-shape primitives are
    built now rather than during serving (layers of one shape share them). Row counts the GEMV
    or the panel GEMM take never reach oneDNN and are skipped."""
    shapes = {(m.in_features, m.out_features, m.bias is not None): m for m in linears}
    for m in shapes.values():
        for rows in row_buckets(m.weight.dtype):
            if rows > max(m._gemv_rows, m._panel_rows):
                m(torch.zeros(rows, m.in_features, dtype=m.weight.dtype))


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied lm_head / embeddings)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}
