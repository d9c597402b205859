"""Model runner: one SchedulerOutput in, one forward pass, one sampled token per sampling row.

The only stage that touches the device. A step's batch is flat: decode tokens first (one per
sequence, sorted longest context first), then each prefill chunk. No padding tokens are computed;
logits are computed only for rows that sample. The attention backend's builder, chosen at load
(models/attention/select.py), turns the step's sequences into its metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from inferd.config import CacheConfig, LoRAConfig
from inferd.executor.cuda_graphs import DecodeGraphs
from inferd.executor.kv_pool import kv_cache_dtype, num_kv_blocks, zeroed_pool
from inferd.executor.spec_verify import Rewind, accept, draft_rows
from inferd.lora.manager import LoRAManager
from inferd.models import kernels, kv_int8
from inferd.models.attention import AttentionMetadata, ScheduledBatch
from inferd.models.attention.base import cache_slots, device_tensor
from inferd.models.attention.select import AttentionBuilder, graph_varlen, select_attention
from inferd.models.attention.varlen import VarlenBuilder
from inferd.models.config import ArchConfig
from inferd.models.kernels.greedy import GreedyHead
from inferd.models.registry import CausalLM
from inferd.sampling.metadata import SamplingMetadata, SamplingRow
from inferd.sampling.sampler import Sampler, SamplerOutput, make_generator
from inferd.sampling.structured import TokenConstraint
from inferd.scheduler.output import ScheduledChunk, SchedulerOutput
from inferd.telemetry.step_stats import StepStat, timed
from inferd.types import ModelRunnerOutput

if TYPE_CHECKING:
    from inferd.sampling.grammar import GrammarMasks

logger = logging.getLogger("inferd.executor")


@dataclass
class ModelInput:
    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: Tensor  # [N] rows of the flat batch that sample
    # The chunks that sample; chunk i owns its num_drafts + 1 rows of logits_indices, in order.
    sampling_chunks: list[ScheduledChunk]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        arch: ArchConfig,
        device: torch.device,
        dtype: torch.dtype,
        cache: CacheConfig,
        native: kernels.NativeKernels | None,
        greedy_screen: bool = True,
        num_blocks: int | None = None,
    ) -> None:
        """`native`: the native CPU kernels (kernels.select), None for the PyTorch path.
        `greedy_screen`: plain greedy batches take their tokens from the lm_head's greedy screen
        (kernels/greedy.py). `num_blocks`: the KV pool's size (None: what `cache` holds)."""
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = cache.block_size
        self.kv_dtype = kv_cache_dtype(cache, dtype)
        self.num_blocks = num_blocks or num_kv_blocks(arch, cache, self.kv_dtype, device)
        # One block more than the block manager hands out: the scratch block that padded rows of a
        # CUDA-graph decode batch write to.
        kv_shape = (
            2,
            self.num_blocks + 1,
            cache.block_size,
            arch.num_key_value_heads,
            kv_int8.row_width(arch.head_dim, self.kv_dtype),
        )
        self.kv_caches = [
            zeroed_pool(kv_shape, self.kv_dtype, device) for _ in range(arch.num_hidden_layers)
        ]
        self.attn_kernel = None if native is None else native.attention
        # The attention backend of eager steps, as its metadata builder (select.py has the rule).
        self.attention: AttentionBuilder = select_attention(
            self.attn_kernel, arch, device, dtype, cache.block_size
        )
        for attn, kv in zip(model.attention_layers(), self.kv_caches, strict=True):
            attn.kv_cache = kv
            attn.kernel = self.attn_kernel
        if native is None:
            model.use_fused_ops(None)
        else:
            model.use_fused_ops(native.ops, native.decode)
        self.sampler = Sampler(None if native is None else native.ops.argmax)
        self.greedy_head = _greedy_head(model, native) if greedy_screen else None
        self.generators: dict[str, torch.Generator] = {}
        self.decode_graphs: DecodeGraphs | None = None
        # Created with the first constrained batch: xgrammar loads only when a request needs it.
        self.grammar_masks: GrammarMasks | None = None
        # LoRA adapters' slots and rows (use_lora), None while LoRA is off.
        self.lora: LoRAManager | None = None

    def use_lora(self, config: LoRAConfig) -> LoRAManager:
        """Turns LoRA on: slots in every LoRA-capable layer; each step tells them its rows."""
        self.lora = LoRAManager(config, self.model.use_lora, self.dtype, self.device)
        return self.lora

    def enable_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool) -> None:
        """Pure-decode steps run from static buffers: CUDA graphs when `capture`, else eagerly."""
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.device,
            self.block_size,
            max_model_len,
            max_num_seqs,
            scratch_block=self.num_blocks,
            capture=capture,
            varlen=graph_varlen(self.attention),
        )

    @property
    def varlen(self) -> bool:
        """Whether eager steps take CUDA's varlen call."""
        return isinstance(self.attention, VarlenBuilder)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv in self.kv_caches)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, stat: StepStat) -> ModelRunnerOutput:
        graphs = self.decode_graphs
        if self.lora is not None and any(c.request.lora_name for c in sched.chunks):
            graphs = None  # the captured graphs have no LoRA term
        if graphs is not None and graphs.can_run(sched.chunks, sched.num_batched_tokens):
            return self._execute_graph(graphs, sched, stat)
        with timed(stat, "prepare_inputs"):
            inp = self.prepare_inputs(sched)
            stat.num_decode_tokens = inp.meta.num_decode_tokens
            stat.num_prefill_tokens = int(inp.input_ids.numel()) - inp.meta.num_decode_tokens

        def forward() -> Tensor:
            return self.model(inp.input_ids, inp.positions, inp.meta, inp.logits_indices)

        return self._forward_and_sample(stat, inp.sampling_chunks, forward)

    def _execute_graph(
        self, graphs: DecodeGraphs, sched: SchedulerOutput, stat: StepStat
    ) -> ModelRunnerOutput:
        stat.num_decode_tokens = len(sched.chunks)

        rows = [i for i, c in enumerate(sched.chunks) if c.samples]

        def forward() -> Tensor:
            return graphs.run(sched.chunks)[self._tensor(rows)]

        return self._forward_and_sample(stat, [sched.chunks[i] for i in rows], forward)

    def _forward_and_sample(
        self, stat: StepStat, chunks: list[ScheduledChunk], forward: Callable[[], Tensor]
    ) -> ModelRunnerOutput:
        """`forward()` -> the hidden states of the sampling rows (`chunks`', num_drafts + 1
        each: spec_verify.py); the lm_head is timed with it as the forward stage (on a GPU by
        CUDA events: _charge_device_time), then the rows are sampled and the drafts verified.
        A plain greedy batch the greedy screen takes skips the full lm_head and the sampler: the
        screen gives the same tokens (kernels/greedy.py)."""
        with timed(stat, "sample"):
            rows = [r for c in chunks for r in draft_rows(self._sampling_row(c), c)]
            meta = SamplingMetadata.build(rows, self.arch.vocab_size, self.device)
            rewind = Rewind.of(chunks, rows, self.arch.vocab_size)
        with timed(stat, "forward"):
            start = _device_event(self.device)
            hidden = forward()
            tokens = None
            if self.greedy_head is not None and meta.plain_greedy:
                tokens = self.greedy_head(hidden)
            logits = None if tokens is not None else self.model.compute_logits(hidden, False)
            end = _device_event(self.device)
        # A grammar's chunk: its first row, its grammar and its drafts (a mask per draft row).
        first_rows = np.cumsum([0] + [c.num_drafts + 1 for c in chunks])
        grammars = [
            (int(first_rows[i]), c.request.grammar, c.draft_token_ids, i)
            for i, c in enumerate(chunks)
            if c.request.grammar
        ]
        if meta.constrained and logits is not None:
            with timed(stat, "grammar"):
                logits = self._mask(logits, grammars)
        with timed(stat, "sample"):
            if logits is not None:
                out = self.sampler(logits, meta)
            else:
                assert tokens is not None
                out = SamplerOutput(token_ids=tokens)
            token_ids: list[int] = out.token_ids.tolist()
            new_tokens, logprobs = accept(
                chunks, token_ids, out.to_sample_logprobs(rows, token_ids)
            )
            rewind(chunks, new_tokens)
        if grammars:
            with timed(stat, "grammar"):
                for row, grammar, _, i in grammars:
                    _accept(grammar, new_tokens[i], row)
        _charge_device_time(stat, start, end)
        return ModelRunnerOutput(
            req_ids=[c.request.request_id for c in chunks],
            sampled_token_ids=new_tokens,
            logprobs=logprobs,
        )

    def _mask(
        self, logits: Tensor, grammars: list[tuple[int, TokenConstraint, list[int], int]]
    ) -> Tensor:
        """Float32 logits with every active grammar's refused tokens at -inf (per draft row)."""
        from inferd.sampling.grammar import GrammarMasks, RequestGrammar

        if self.grammar_masks is None:
            self.grammar_masks = GrammarMasks(self.arch.vocab_size)
        logits = logits.float()
        active = [
            (r, g, drafts)
            for r, g, drafts, _ in grammars
            if g.active and isinstance(g, RequestGrammar)
        ]
        self.grammar_masks.apply(logits, active)
        return logits

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        # Decode rows, longest first, then prompt chunks; with LoRA each adapter's rows together
        # (its decode rows, then its chunks), so a LoRA layer reads each adapter's rows as a view.
        decode = sorted(
            (c for c in sched.chunks if c.num_tokens == 1),
            key=lambda c: (c.request.lora_name or "", -c.start),
        )
        prefill = [c for c in sched.chunks if c.num_tokens > 1]
        if self.lora is not None:
            prefill.sort(key=lambda c: c.request.lora_name or "")
            self.lora.set_step(_row_runs(decode + prefill))
        chunks = decode + prefill
        ids: list[int] = [c.request.all_token_ids[c.start] for c in decode]
        positions: list[int] = [c.start for c in decode]
        bs = self.block_size
        slots: list[int] = [c.block_ids[c.start // bs] * bs + c.start % bs for c in decode]
        for c in prefill:
            end = c.start + c.num_tokens
            slots.extend(cache_slots(c.block_ids, c.start, end, bs).tolist())
            ids.extend(c.token_ids())
            positions.extend(range(c.start, end))
        # A sampling chunk's rows: its last known token's, then one per draft.
        sample_rows = [c.num_drafts + 1 if c.samples else 0 for c in chunks]
        sampling_rows: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        row = 0
        for c, n in zip(chunks, sample_rows, strict=True):
            row += c.num_tokens
            if n:
                sampling_rows.extend(range(row - n, row))
                sampling_chunks.append(c)
        batch = ScheduledBatch(
            starts=[c.start for c in chunks],
            q_lens=[c.num_tokens for c in chunks],
            block_ids=[c.block_ids for c in chunks],
            sample_rows=sample_rows,
            num_decode=len(decode),
            slot_mapping=self._tensor(slots),
        )
        return ModelInput(
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            meta=self.attention.build(batch),
            logits_indices=self._tensor(sampling_rows),
            sampling_chunks=sampling_chunks,
        )

    def _tensor(self, values: list[int] | np.ndarray) -> Tensor:
        return device_tensor(values, self.device)

    def _sampling_row(self, c: ScheduledChunk) -> SamplingRow:
        req = c.request
        gen = None
        if req.sampling_params.seed is not None:
            gen = self.generators.get(req.request_id)
            if gen is None:
                gen = make_generator(req.sampling_params.seed, self.device)
                self.generators[req.request_id] = gen
        return SamplingRow(
            params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            eos_token_ids=req.eos_token_ids,
            generator=gen,
            constrained=req.grammar is not None and req.grammar.active,
        )


def _row_runs(chunks: list[ScheduledChunk]) -> list[tuple[str | None, int, int]]:
    """(adapter, first row, end row) of each run of rows under one adapter (None: the base
    model), adjacent runs of one adapter merged."""
    runs: list[tuple[str | None, int, int]] = []
    row = 0
    for c in chunks:
        name = c.request.lora_name
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], row + c.num_tokens)
        else:
            runs.append((name, row, row + c.num_tokens))
        row += c.num_tokens
    return runs


def _accept(grammar: TokenConstraint, new_tokens: list[int], row: int) -> None:
    """Keeps the accepted drafts the mask step advanced the grammar through, then advances it
    over the step's other new tokens (the sampled one)."""
    for token_id in new_tokens[grammar.rollback_drafts(len(new_tokens) - 1) :]:
        if not grammar.accept(token_id):
            # The mask allowed only what the grammar accepts: a refusal is a bug, not bad input.
            logger.error("grammar refused sampled token %d (row %d)", token_id, row)


def _device_event(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded on the current CUDA stream now; None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


def _greedy_head(model: CausalLM, native: kernels.NativeKernels | None) -> GreedyHead | None:
    """The greedy screen of the model's lm_head, where the native kernels run and the lm_head has
    a panel copy (kernels/greedy.py has the other conditions)."""
    head = model.logits_head()
    if native is None or head is None:
        return None
    greedy = GreedyHead.of(
        native.screen, native.gemv.panel_rows, head.panel_copy(), head.plain_weight()
    )
    if greedy is not None:
        logger.info(
            "greedy batches: int8 screen of the lm_head (%d columns) + exact logits of the "
            "candidates",
            greedy.panel.out_features,
        )
    return greedy


def _charge_device_time(
    stat: StepStat, start: torch.cuda.Event | None, end: torch.cuda.Event | None
) -> None:
    """Counts a GPU forward's device time as forward, not sample.

    On a GPU the forward stage's host time is only the kernel launches: the host waits for the
    kernels when sampling reads the token ids back, so the sample stage's wall time held most of
    the forward (39 % "sample" on a Qwen2-0.5B-shape H100 run). After that read both events are
    complete; the forward's device time beyond what the forward stage counted moves from sample
    to forward, and the step's total stays the same.
    """
    if start is None or end is None:
        return
    device_s = start.elapsed_time(end) / 1e3
    moved = min(max(device_s - stat.forward, 0.0), stat.sample)
    stat.forward += moved
    stat.sample -= moved
