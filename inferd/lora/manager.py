"""The adapters an engine knows, holds in host memory and has in slots for the step being run.

Three tiers, as S-LoRA's unified pool and vLLM's `--max-loras` / `--max-cpu-loras`:
- known: registered by name (`--lora-modules`, the load endpoint, or the offline API's
  LoRARequest); nothing is read from disk yet.
- loaded: packed factors in host memory (adapter.py), read by one background thread, so a load
  never stalls the step loop; at most `cpu_capacity` of them, the least recently used evicted,
  but never one an unfinished request runs under (those are pinned; the cap is exceeded rather
  than a request left without its adapter).
- in a slot: copied into slot s of every LoRA layer (layer.py) when a step first needs it, the
  least recently used slot not needed by this step reused. The scheduler admits at most
  `max_loras` distinct adapters per step, so a step always finds its slots.

An unregistered adapter stops being known at once (new requests for it are refused); its host
copy and slot go once no unfinished request runs under it (`collect`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from inferd.config import LoRAConfig
from inferd.errors import InvalidRequestError
from inferd.lora.adapter import LoRAAdapter, ShardTarget, load_adapter
from inferd.lora.layer import GroupedRows, LoRABatch, LoRALayer, LoRATarget, Rows
from inferd.lora.request import LoRARequest

logger = logging.getLogger("inferd.lora")

# Adapters with at most this many rows in a step may run grouped (layer.py).
GROUPED_MAX_ROWS = 32
# (adapter name or None for the base model, first row, end row) of the flat batch.
RowRun = tuple[str | None, int, int]
# Reads, checks and packs an adapter's files for the model's layers (adapter.py's load_adapter
# for PEFT folders): (request, targets, max_rank, dtype) -> the adapter.
AdapterReader = Callable[[LoRARequest, dict[str, ShardTarget], int, torch.dtype], LoRAAdapter]


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        attach: Callable[[LoRABatch], Sequence[tuple[str, LoRATarget]]],
        dtype: torch.dtype,
        device: torch.device,
        reader: AdapterReader = load_adapter,
    ) -> None:
        """`attach`: the model's `use_lora`, which takes the step's rows and returns its
        LoRA-capable layers by name. `reader`: how an adapter's files are read."""
        self.config = config
        self.reader = reader
        self.dtype = dtype
        self.device = device
        self.batch = LoRABatch()
        linears = attach(self.batch)
        self.targets = _targets(linears)
        self.layers: dict[str, LoRALayer] = {}
        for name, linear in linears:
            linear.lora = self.layers[name] = LoRALayer(
                self.batch, linear, config.max_loras, config.max_lora_rank, dtype, device
            )
        self._known: dict[str, LoRARequest] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._loading: dict[str, concurrent.futures.Future[LoRAAdapter]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "inferd-lora-load")
        # Slot s holds the adapter `_slot_names[s]`; `_slot_lru` orders slots, least recent first.
        self._slot_of: dict[str, int] = {}
        self._slot_names: list[str | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(config.max_loras)
        )
        logger.info(
            "LoRA: %d layers, %d adapters a step, rank <= %d, %d in host memory",
            len(self.layers),
            config.max_loras,
            config.max_lora_rank,
            config.cpu_capacity,
        )

    # -- known ---------------------------------------------------------------------------------

    def register(self, request: LoRARequest) -> LoRARequest:
        """Makes `request` known (the one already known under its name if it is the same
        folder). Raises InvalidRequestError for a name taken by another folder. An adapter whose
        load failed is absent here from the moment it failed, not from the next engine step."""
        self._forget_failed(request.lora_name)
        known = self._known.get(request.lora_name)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise InvalidRequestError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from "
                    f"{known.lora_path}; unload it first",
                    "lora_name",
                )
            return known
        held = self._loaded.get(request.lora_name)
        if held is not None and held.request.lora_path != request.lora_path:
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r} is still in use by running requests; "
                "retry once they finish",
                "lora_name",
            )
        self._known[request.lora_name] = request
        return request

    def unregister(self, name: str) -> bool:
        return self._known.pop(name, None) is not None and not self._failed(name)

    def get(self, name: str) -> LoRARequest | None:
        return None if self._failed(name) else self._known.get(name)

    def known(self) -> list[LoRARequest]:
        return [r for name, r in self._known.items() if not self._failed(name)]

    def _failed(self, name: str) -> bool:
        future = self._loading.get(name)
        return future is not None and future.done() and future.exception() is not None

    def _forget_failed(self, name: str) -> None:
        if self._failed(name):
            del self._loading[name]
            self._known.pop(name, None)

    # -- loaded --------------------------------------------------------------------------------

    def load(self, name: str) -> concurrent.futures.Future[LoRAAdapter]:
        """The known adapter `name` in host memory: a done future when it is, else its load (one
        per adapter at a time). A failed load unregisters it; the future raises the reason."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            done: concurrent.futures.Future[LoRAAdapter] = concurrent.futures.Future()
            done.set_result(adapter)
            return done
        future = self._loading.get(name)
        if future is None or (future.done() and future.exception() is not None):
            # A failed load not yet collected by take_loaded is tried again, not answered
            # with its old failure: the folder may have been fixed since.
            request = self._known[name]
            future = self._pool.submit(
                self.reader, request, self.targets, self.config.max_lora_rank, self.dtype
            )
            self._loading[name] = future
        return future

    def take_loaded(self, in_use: Iterable[str]) -> None:
        """Moves finished loads into host memory (failed ones are unregistered), then evicts
        what is over capacity. Call from the engine loop: the one thread that changes state."""
        for name, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            if future.exception() is None:
                self._loaded[name] = future.result()
            elif self._known.get(name) is not None:
                self._known.pop(name)
        self.collect(in_use)

    def collect(self, in_use: Iterable[str]) -> None:
        """Drops host copies (and slots) of unregistered adapters and, over capacity, of the
        least recently used, never one in `in_use` (an unfinished request's adapter)."""
        pinned = set(in_use)
        for name in [n for n in self._loaded if n not in self._known and n not in pinned]:
            self._drop(name)
        excess = len(self._loaded) - self.config.cpu_capacity
        for name in [n for n in self._loaded if n not in pinned][: max(excess, 0)]:
            self._drop(name)

    def _drop(self, name: str) -> None:
        del self._loaded[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._slot_names[slot] = None
            self._slot_lru.move_to_end(slot, last=False)

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    # -- the step ------------------------------------------------------------------------------

    def set_step(self, runs: list[RowRun]) -> None:
        """The step's rows by adapter: puts each adapter present in a slot and sets the batch's
        segments (base-model runs have none)."""
        rows: dict[str, list[tuple[int, int]]] = {}
        for name, lo, hi in runs:
            if name is not None:
                rows.setdefault(name, []).append((lo, hi))
        self.place(list(rows))
        # Adapters with few rows (decode) together, when there are enough of them that one
        # batched GEMM over every slot does less than one pair of GEMMs each.
        few = [n for n, spans in rows.items() if _count(spans) <= GROUPED_MAX_ROWS]
        if len(few) < max(2, len(self._slot_names) // 2):
            few = []
        self.batch.grouped = self._grouped({n: rows[n] for n in few}) if few else None
        self.batch.segments = [
            (self._slot_of[n], _rows(spans, self.device))
            for n, spans in rows.items()
            if n not in few
        ]

    def place(self, names: list[str]) -> dict[str, int]:
        """Puts the step's adapters `names` (loaded, at most `max_loras`) in slots, keeping those
        already in one: {name: its slot}."""
        needed = set(names)
        assert len(needed) <= len(self._slot_names), "the scheduler admits max_loras per step"
        for adapter in names:  # in row order: the same slots every run
            self._to_slot(adapter, needed)
        return {n: self._slot_of[n] for n in names}

    def _grouped(self, rows: dict[str, list[tuple[int, int]]]) -> GroupedRows:
        max_rows = max(_count(spans) for spans in rows.values())
        src: list[int] = []
        dst: list[int] = []
        for name, spans in rows.items():
            base = self._slot_of[name] * max_rows
            index = [i for lo, hi in spans for i in range(lo, hi)]
            src += index
            dst += range(base, base + len(index))
        run = (src[0], src[-1] + 1) if src == list(range(src[0], src[-1] + 1)) else None
        return GroupedRows(
            torch.tensor(src, device=self.device),
            torch.tensor(dst, device=self.device),
            max_rows,
            tuple(self._slot_of[n] for n in rows),
            run,
        )

    def _to_slot(self, name: str, needed: set[str]) -> None:
        slot = self._slot_of.get(name)
        if slot is None:
            slot = next(s for s in self._slot_lru if self._slot_names[s] not in needed)
            old = self._slot_names[slot]
            if old is not None:
                del self._slot_of[old]
            adapter = self._loaded[name]
            for layer_name, layer in self.layers.items():
                layer.load(slot, adapter.layers.get(layer_name))
            self._slot_names[slot] = name
            self._slot_of[name] = slot
        self._slot_lru.move_to_end(slot)


def _count(spans: list[tuple[int, int]]) -> int:
    return sum(hi - lo for lo, hi in spans)


def _rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    """One adapter's rows: a slice when they are one run, else their indices."""
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(lo, hi) for lo, hi in spans]).to(device)


def _targets(linears: Sequence[tuple[str, LoRATarget]]) -> dict[str, ShardTarget]:
    """Each checkpoint layer an adapter may target (`model.layers.0.self_attn.q_proj`) -> where
    it lives in the model's fused layers."""
    out: dict[str, ShardTarget] = {}
    for name, linear in linears:
        parent = name.rpartition(".")[0]
        start = 0
        for i, (shard, rows) in enumerate(linear.shards):
            key = f"{parent}.{shard}" if parent else shard
            out[key] = ShardTarget(name, i, start, rows, linear.in_features, linear.out_features)
            start += rows
    return out
