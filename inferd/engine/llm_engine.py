"""The engine: one short step loop, schedule -> execute -> update.

    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()

Everything else (tokenizing, validating, fanning out `n` choices, detokenizing, stop strings)
happens around that loop, not inside the scheduler or the runner.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from inferd.admission.prompt_check import check_prompt
from inferd.config import EngineConfig, Environment, SpeculativeConfig, read_environment
from inferd.engine.info import EngineInfo
from inferd.engine.output_processor import OutputKind, OutputProcessor
from inferd.engine.waits import Ready, Wait, Waits
from inferd.errors import InvalidRequestError, ModelLoadError
from inferd.executor.device import (
    configure_threads,
    keep_freed_memory,
    release_freed_memory,
    resolve_device,
)
from inferd.executor.draft_runner import DraftRunner
from inferd.executor.loading import load_runner
from inferd.kv_cache.block_manager import BlockManager
from inferd.kv_cache.events import KVEventPublisher
from inferd.lora.request import LoRARequest
from inferd.models.config import ArchConfig
from inferd.models.loader import resolve_model_path
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams
from inferd.scheduler.output import SchedulerOutput
from inferd.scheduler.request import Request, RequestStatus
from inferd.scheduler.scheduler import Scheduler
from inferd.spec_decode.draft_model import DraftModelProposer
from inferd.spec_decode.drafter import Drafter
from inferd.telemetry.step_stats import StepStat, StepStats, timed
from inferd.types import RequestOutput

if TYPE_CHECKING:
    from inferd.lora.adapter import LoRAAdapter
    from inferd.sampling.grammar import GrammarCompiler

logger = logging.getLogger("inferd.engine")
# How long a step with nothing to schedule waits for a grammar or adapter before it returns.
_WAIT_POLL_S = 0.005


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | TokensPrompt


class LLMEngine:
    def __init__(self, config: EngineConfig, env: Environment | None = None) -> None:
        """`env`: the server passes the environment it read at start-up; the offline API reads
        it here, its own start-up."""
        self.config = config
        env = env or read_environment()
        self.device = resolve_device(config.device)
        configure_threads(self.device, config.device.num_threads)
        keep_freed_memory(self.device)
        torch.manual_seed(config.model.seed)
        target = load_runner(config, config.model, self.device, env)
        path, dtype = target.path, target.dtype
        self.model, self.arch, self.runner = target.model, target.arch, target.runner
        tok_path = path
        if config.model.tokenizer is not None:
            tok_path = resolve_model_path(config.model.tokenizer, None, env)
        self.tokenizer = Tokenizer.from_pretrained(tok_path)
        self.tokenizer_path = tok_path
        release_freed_memory(self.device)
        events_endpoint = config.cache.kv_events_endpoint
        block_manager = BlockManager(
            self.runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            kv_events=events_endpoint is not None,
            # For the block digest a router reads (GET /v1/kv_cache/blocks): ~1 us a block.
            block_hashes=True,
            # Blocks wholly before every layer's window go back to the pool as a sequence grows.
            window=self.arch.kv_window,
        )
        self.max_model_len = self._max_model_len(block_manager)
        # (Not for MoE: the grouped GEMMs read each expert's row count on the host.)
        if self.device.type == "cuda" and not config.device.enforce_eager and self.arch.moe is None:
            self.runner.enable_decode_graphs(
                self.max_model_len, config.scheduler.max_num_seqs, capture=True
            )
        # Binds at start-up, so a taken address fails the load instead of the first step.
        self.kv_events = None if events_endpoint is None else KVEventPublisher(events_endpoint)
        lora = config.lora
        self.lora = self.runner.use_lora(lora) if lora.enable_lora else None
        max_loras = lora.max_loras if lora.enable_lora else None
        self.scheduler = Scheduler(config.scheduler, block_manager, self.max_model_len, max_loras)
        self._load_lora_modules()
        self.outputs = OutputProcessor(self.tokenizer.hf)
        self.eos_token_ids = self.tokenizer.eos_token_ids | frozenset(self.arch.eos_token_ids)
        self.step_stats = StepStats()
        self.drafter = self._drafter(env, dtype)
        self._aborted: list[str] = []
        # Structured outputs: the compiler (made with the first constrained request, so xgrammar
        # loads only when used). Requests waiting for their grammar or adapter, and those refused
        # after add_request returned (a grammar that did not compile in time, or at all; an
        # adapter that did not load).
        self._grammar_compiler: GrammarCompiler | None = None
        self._waits = Waits(config.structured_outputs.grammar_compile_timeout_s, self._lora_loaded)
        self._refused: list[tuple[str, InvalidRequestError]] = []
        # Requests preempted (recompute) since start; the server exports it as a counter.
        self.num_preemptions_total = 0
        self.info = EngineInfo(
            model_path=str(path),
            architecture=self.arch.architecture,
            device=str(self.device),
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            num_kv_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
            vocab_size=self.arch.vocab_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            reasoning_parser=config.structured_outputs.reasoning_parser,
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) on %s; max_model_len %d",
            self.runner.num_blocks,
            config.cache.block_size,
            self.runner.num_blocks * config.cache.block_size,
            self.runner.kv_cache_bytes / 2**20,
            self.device,
            self.max_model_len,
        )

    def _drafter(self, env: Environment, dtype: torch.dtype) -> Drafter | None:
        spec = self.config.speculative.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return Drafter(spec)
        return Drafter(spec, self._draft_model(spec, env, dtype))

    def _draft_model(
        self, spec: SpeculativeConfig, env: Environment, dtype: torch.dtype
    ) -> DraftModelProposer:
        """The draft model in this process, in the target's dtype, with a KV pool of the target's
        blocks plus room for every sequence's drafts (spec_decode/draft_model.py)."""
        assert spec.model is not None
        bs = self.config.cache.block_size
        max_seqs = self.config.scheduler.max_num_seqs
        num_blocks = self.runner.num_blocks + max_seqs * (-(-spec.num_speculative_tokens // bs) + 1)
        model = self.config.model.model_copy(
            update={"model": spec.model, "tokenizer": None, "revision": None}
        )
        # Checked from its config.json, before its weights are read.
        draft_path = resolve_model_path(spec.model, None, env)
        vocab_size = ArchConfig.from_json(draft_path / "config.json").vocab_size
        if vocab_size != self.arch.vocab_size:
            raise ModelLoadError(
                f"draft model {spec.model!r} has vocab_size {vocab_size}, the model "
                f"{self.config.model.model!r} {self.arch.vocab_size}: a draft must share the "
                "target's vocabulary"
            )
        draft = load_runner(self.config, model, self.device, env, dtype, num_blocks)
        blocks = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        return DraftModelProposer(DraftRunner(draft.runner), blocks, self.max_model_len)

    def _max_model_len(self, bm: BlockManager) -> int:
        # How far rope reaches (scaled); a sliding window limits what a layer attends to, not this.
        limit = self.arch.max_context_len
        requested = self.config.model.max_model_len
        if requested is not None:
            if requested > limit:
                raise ModelLoadError(
                    f"max_model_len {requested} exceeds what the model supports ({limit})"
                )
            limit = requested
        # A single request must always fit in the cache, or it could never be scheduled; with
        # sliding windows on every layer it holds only its window's blocks (block_manager.py).
        if bm.max_blocks_held(limit, self.config.scheduler.max_num_batched_tokens) <= bm.num_blocks:
            return limit
        return min(limit, bm.num_blocks * bm.block_size)

    # -- requests in ---------------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}", "prompt")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request; past `deadline` (a time.monotonic() instant) the scheduler finishes
        it with finish_reason "timeout" (see Scheduler.expire). `lora_request`: the adapter it
        runs under, registered here if new; it waits (off the step loop) until loaded."""
        if request_id in self.outputs.states or request_id in self._waits:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in flight", "request_id"
            )
        lora_name = None if lora_request is None else self._lora(lora_request).lora_name
        text, ids = self.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                sampling_params=params.for_child(i) if params.n > 1 else params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                deadline=deadline,
                lora_name=lora_name,
            )
            for i in range(params.n)
        ]
        now = time.monotonic()
        wait = Wait(request_id, text, children, output_kind, now)
        if params.structured_outputs is not None:
            wait.grammar = self.grammar_compiler().submit(params.structured_outputs)
            wait.deadline = now + self.config.structured_outputs.grammar_compile_timeout_s
        if self.lora is not None and lora_name is not None:
            future = self.lora.load(lora_name)
            wait.adapter = None if self.lora.is_loaded(lora_name) else future
        self._waits.add(wait)
        # Nothing to wait for (or a cached grammar): scheduled like any other, now.
        self._admit_waits()

    def _admit(self, ready: Ready) -> None:
        wait = ready.wait
        if ready.grammar is not None:
            from inferd.sampling.grammar import RequestGrammar

            start, end = self._reasoning_markers
            for child in wait.children:
                child.grammar = RequestGrammar(ready.grammar, child.prompt_token_ids, start, end)
        self.outputs.add(
            wait.request_id,
            wait.prompt,
            wait.children,
            wait.output_kind,
            ready.grammar_compile_s,
            ready.lora_load_s,
        )
        for child in wait.children:
            self.scheduler.add_request(child)

    def _admit_waits(self) -> None:
        """Schedules the held requests whose grammar and adapter are ready; refuses those whose
        grammar or adapter failed, or whose grammar is past its deadline."""
        if self.lora is not None:
            self.lora.take_loaded(self._lora_in_use())
        ready, refused = self._waits.take(time.monotonic())
        for r in ready:
            self._admit(r)
        self._refused.extend(refused)

    # -- LoRA adapters -------------------------------------------------------------------------

    def _lora(self, request: LoRARequest) -> LoRARequest:
        if self.lora is None:
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_name!r} asked for, but LoRA is off (--enable-lora)",
                "model",
            )
        return self.lora.register(request)

    def _load_lora_modules(self) -> None:
        """The adapters of `--lora-modules`, loaded before serving; a bad one fails start-up."""
        for i, module in enumerate(self.config.lora.lora_modules):
            folder = str(Path(module.path).expanduser())
            request = LoRARequest(module.name, i + 1, folder, module.base_model_name)
            try:
                self.add_lora(request).result()
            except InvalidRequestError as e:
                raise ModelLoadError(str(e)) from e
        if self.lora is not None:
            self.lora.take_loaded(())

    def _lora_loaded(self, name: str) -> bool:
        return self.lora is not None and self.lora.is_loaded(name)

    def _lora_in_use(self) -> set[str]:
        return self.scheduler.lora_names() | self._waits.lora_names()

    def add_lora(self, request: LoRARequest) -> concurrent.futures.Future[None]:
        """Registers an adapter and loads it in the background. The future raises the reason
        it did not load (InvalidRequestError); it is then no longer registered."""
        name = self._lora(request).lora_name
        assert self.lora is not None
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()

        def done(future: concurrent.futures.Future[LoRAAdapter]) -> None:
            error = future.exception()
            if error is None:
                loaded.set_result(None)
            else:
                loaded.set_exception(error)

        self.lora.load(name).add_done_callback(done)
        return loaded

    def remove_lora(self, lora_name: str) -> bool:
        """Unregisters an adapter (False: unknown). Requests running under it finish first;
        its memory is freed once they have."""
        if self.lora is None or not self.lora.unregister(lora_name):
            return False
        self.lora.collect(self._lora_in_use())
        return True

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.known()

    # -- structured outputs --------------------------------------------------------------------

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            from inferd.sampling.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.hf, self.arch.vocab_size, self.eos_token_ids
            )
        return self._grammar_compiler

    @property
    def grammar_cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the compiled-grammar cache."""
        c = self._grammar_compiler
        return (0, 0) if c is None else (c.hits, c.misses)

    @functools.cached_property
    def _reasoning_markers(self) -> tuple[list[int], list[int]]:
        """Token ids of the reasoning parser's start and end markers; empty without one."""
        name = self.config.structured_outputs.reasoning_parser
        if name is None:
            return [], []
        from inferd.postprocess.reasoning import get_reasoning_parser

        parser = get_reasoning_parser(name)
        encode = self.tokenizer.encode
        return (
            encode(parser.start, add_special_tokens=False),
            encode(parser.end, add_special_tokens=False),
        )

    def take_refused(self) -> list[tuple[str, InvalidRequestError]]:
        """Requests refused since the last call, after add_request had accepted them."""
        refused, self._refused = self._refused, []
        return refused

    def validate(self, ids: Sequence[int], params: SamplingParams) -> int:
        """Checks a tokenized prompt against the model; returns the resolved max_tokens."""
        return check_prompt(
            ids,
            params.max_tokens,
            max_model_len=self.max_model_len,
            vocab_size=self.arch.vocab_size,
        )

    def abort_request(
        self,
        request_ids: str | Sequence[str],
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """Finishes requests at any point with `status` (by default an abort).

        The final output (finish_reason 'abort') comes from the next step()."""
        assert status.finished, f"{status!r} is not a finished status"
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._waits.remove(ids)
        for rid in ids:
            child_ids = self.outputs.abort(rid, status)
            if child_ids:
                self.scheduler.finish_requests(child_ids, status)
                self._release(child_ids)
                self._aborted.append(rid)

    # -- the loop ------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted) or bool(self._waits)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        stat = StepStat()
        if self._waits or (self.lora is not None and self.lora.loading):
            self._admit_waits()
        self._expire(time.monotonic())
        outputs = self.outputs.drain_aborted(self._aborted)
        self._aborted = []
        with timed(stat, "schedule"):
            if self.drafter is not None:
                self.drafter.propose(self.scheduler.running_requests())
            sched = self.scheduler.schedule()
        if sched.is_empty and self._waits and not outputs:
            # Nothing to run until a grammar or adapter is ready: wait for one, and schedule
            # what it let in within this step rather than the next.
            self._waits.wait_any(_WAIT_POLL_S)
            self._admit_waits()
            with timed(stat, "schedule"):
                sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self.outputs.mark_scheduled([c.request.request_id for c in sched.chunks], time.monotonic())
        self.num_preemptions_total += len(sched.preempted_ids)
        runner_out = self.runner.execute(sched, stat)
        stat.expert_rows = self.model.expert_rows()
        if self.drafter is not None:
            stat.num_draft_tokens, stat.num_accepted_tokens = self.drafter.observe(
                sched, runner_out
            )
        with timed(stat, "schedule"):
            updated = self.scheduler.update_from_output(sched, runner_out)
        if stat.grammar:
            self._charge_grammar(sched, stat.grammar)
        with timed(stat, "detokenize"):
            logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs, strict=True))
            new_outputs, stopped = self.outputs.process(updated, logprobs)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            self._release([r.request_id for r in updated if r.is_finished] + stopped)
        stat.num_running = len(sched.chunks)
        stat.num_waiting = self.scheduler.num_waiting
        stat.num_batched_tokens = sched.num_batched_tokens
        stat.total = time.perf_counter() - t0
        self.step_stats.record(stat)
        self._observe_timing(sched, stat)
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.block_manager.take_kv_events())
        return outputs + new_outputs

    def _observe_timing(self, sched: SchedulerOutput, stat: StepStat) -> None:
        """The step's time to the step budget's cost model, or (a step that verified drafts)
        to the speculation policy's; verified rows are not prompt tokens."""
        verify_rows = sum(c.num_tokens for c in sched.chunks if c.num_drafts)
        prompt_tokens = stat.num_prefill_tokens - verify_rows
        if stat.num_draft_tokens == 0:
            self.scheduler.step_budget.observe(prompt_tokens, stat.total)
        if self.drafter is not None and prompt_tokens == 0:
            self.drafter.policy.observe_step(stat.num_draft_tokens, stat.total)

    def _charge_grammar(self, sched: SchedulerOutput, seconds: float) -> None:
        """Shares the step's mask work evenly among its constrained rows' requests."""
        ids = [c.request.request_id for c in sched.chunks if c.samples and c.request.grammar]
        if ids:
            self.outputs.add_grammar_time(ids, seconds / len(ids))

    def _expire(self, now: float) -> None:
        """Finishes requests past their deadline; their final outputs leave with this step."""
        expired = self.scheduler.expire(now)
        if expired:
            self._release([r.request_id for r in expired])
            self._aborted.extend(self.outputs.finish_children(expired))

    def _release(self, request_ids: list[str]) -> None:
        """Forgets finished requests' per-request state in the runner and the drafter."""
        self.runner.release(request_ids)
        if self.drafter is not None:
            self.drafter.proposer.release(request_ids)

    def run_to_completion(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        return outputs
