"""Continuous batching: which tokens of which requests the next engine step computes.

One token budget per step, vLLM v1 style. There is no separate prefill and decode phase: every
request simply needs `num_tokens - num_computed_tokens` tokens computed (the whole prompt at
first, 1 in steady decode, prompt + outputs after a preemption) and each step hands out at most
`max_num_batched_tokens` of them.

Pure Python, no torch: tested on CPU with a faked model output.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from inferd.admission.lazy_heap import LazyHeap
from inferd.admission.prompt_check import check_context_window
from inferd.config import SchedulerConfig
from inferd.errors import InvalidRequestError
from inferd.kv_cache.block_manager import BlockManager
from inferd.kv_cache.prefix_cache import PrefixHit
from inferd.scheduler.output import ScheduledChunk, SchedulerOutput
from inferd.scheduler.request import Request, RequestStatus
from inferd.scheduler.step_budget import StepBudget
from inferd.scheduler.waiting import FcfsQueue, PriorityQueue, WaitingQueue
from inferd.types import ModelRunnerOutput


class Scheduler:
    """Iteration-level scheduler over a paged KV cache with prefix caching.

    `schedule()`, one step, with a token budget of `StepBudget.tokens()` (see step_budget.py),
    at most `max_num_batched_tokens` and at least one token per running request:
      1. Running requests, in admission order, each get min(needed, budget left) tokens: long
         prefills are chunked across steps (or, with chunked prefill off, wait until they fit
         whole). If the pool is out of blocks, the running request with the largest
         (priority, arrival_time), i.e. lowest priority then newest, is preempted by recompute:
         its blocks are freed, `num_computed_tokens` drops to 0 and it goes back to waiting
         (the front, in fcfs), keeping its outputs. If that victim is the request being
         scheduled, scheduling of running requests stops.
      2. Unless step 1 preempted something (blocks are short: admitting now would take blocks the
         running requests need next step), waiting requests are admitted in FIFO or
         (priority, arrival_time) order while budget, `max_num_seqs` and blocks allow. Each takes
         its cached prefix first (those tokens cost no budget). The first that does not fit stops
         admission; under the "priority" policy it may first preempt running requests of strictly
         lower priority.

    `num_computed_tokens` advances in `update_from_output`, not in `schedule()`: between the two
    it still counts only tokens whose K/V were in the cache before the step, as Request
    documents. A chunk's `start` is that value at schedule time; the runner reads `start`.
    Requests that finish leave the scheduler: `get_request` no longer knows them.

    Prefix-cache accounting happens at a request's first admission only: `prefix_cache` counts
    its prompt tokens as queried and its cached prefix as hit (while prefix caching is on), and
    `Request.num_cached_tokens` keeps that hit.

    LoRA adapters: one step runs at most `max_loras` distinct adapters (the slots the LoRA
    kernels read). In step 2 a waiting request whose adapter would be one too many is passed
    over, keeping its place, and admission goes on with the requests behind it: one popular
    set of adapters never blocks the others' requests, nor base-model ones. Its cached prefix is
    looked up under its adapter (block_manager.py).

    Deadlines live here and only here: `expire(now)` finishes every request whose
    `Request.deadline` has passed, as FINISHED_EXPIRED_WAITING when it has no output token yet
    (a queue timeout) and FINISHED_TIMEOUT otherwise (a generation timeout).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: distinct LoRA adapters a step may run (None: LoRA is off)."""
        self.config = config
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._waiting: WaitingQueue = (
            PriorityQueue() if config.policy == "priority" else FcfsQueue()
        )
        self._running: list[Request] = []
        # Every unfinished request, by id.
        self._requests: dict[str, Request] = {}
        # Deadline order over unfinished requests with a deadline; finished ones are stale.
        self._deadlines: LazyHeap[float, Request] = LazyHeap(_is_unfinished)
        self.prefix_cache = PrefixCacheStats()
        # Without chunked prefill a prompt must fit one step whole: the budget stays fixed.
        target_s = config.step_time_target_ms / 1000 if config.enable_chunked_prefill else 0.0
        self.step_budget = StepBudget(config.max_num_batched_tokens, target_s)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def running_requests(self) -> list[Request]:
        """The running requests, in admission order (a copy)."""
        return list(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def lora_names(self) -> set[str]:
        """The adapters unfinished requests run under: O(requests), for the rare caller that
        frees adapters."""
        return {r.lora_name for r in self._requests.values() if r.lora_name is not None}

    def add_request(self, request: Request) -> None:
        """Queues a new request. Raises InvalidRequestError if it could never be scheduled."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.push(request)
        if request.deadline is not None:
            self._deadlines.push(request.deadline, request)

    def expire(self, now: float) -> list[Request]:
        """Finishes the requests whose deadline is <= now; returns them, earliest deadline first.

        A request with no output token yet gets FINISHED_EXPIRED_WAITING, any other
        FINISHED_TIMEOUT; either frees its blocks at once."""
        expired = self._deadlines.pop_through(now)
        for request in expired:
            status = (
                RequestStatus.FINISHED_EXPIRED_WAITING
                if request.num_output_tokens == 0
                else RequestStatus.FINISHED_TIMEOUT
            )
            self._finish(request, status)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of an unfinished request, None if none has one."""
        top = self._deadlines.peek()
        return None if top is None else top[0]

    # -- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(budget=self._token_budget())
        self._schedule_running(step)
        if not step.preempted_ids:
            self._schedule_waiting(step)
        return step.to_output()

    def _token_budget(self) -> int:
        budget = max(self.step_budget.tokens(), len(self._running))
        return min(self.config.max_num_batched_tokens, budget)

    def _schedule_running(self, step: _StepPlan) -> None:
        # Iterate over a snapshot: preemption removes victims from self._running as we go.
        running = list(self._running)
        for i, request in enumerate(running):
            if step.budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, request.num_computed_tokens, step.budget)
            if num_new == 0:
                continue
            # Drafts take only budget no later running request needs for its own next token.
            drafts = self._drafts(request, num_new, step.budget - (len(running) - i - 1))
            if not self._allocate_running(request, num_new + len(drafts), step):
                return  # the request itself was the victim
            blocks = self.block_manager.block_table(request.request_id)
            step.add(request, num_new + len(drafts), blocks, drafts)

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts this step verifies: only in steady decode (one known token to
        compute), within `budget` and so that every accepted draft is an output the request may
        still have (max_tokens, max_model_len). Takes them off the request."""
        drafts, request.draft_token_ids = request.draft_token_ids, []
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        limit = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return drafts[: max(0, limit)]

    def _allocate_running(self, request: Request, num_new: int, step: _StepPlan) -> bool:
        """Allocates, preempting victims until it fits; False when `request` itself was one."""
        num_tokens = request.num_computed_tokens + num_new
        while not self.block_manager.allocate(request.request_id, num_tokens):
            victim = max(self._running, key=_preemption_key)
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: _StepPlan) -> None:
        adapters = {r.lora_name for r in self._running if r.lora_name is not None}
        passed: list[Request] = []  # adapter over max_loras this step: back in place after
        while self._waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.peek()
            if not self._adapter_fits(request.lora_name, adapters):
                passed.append(self._waiting.pop())
                continue
            # A request preempted in this very step is not readmitted in it: the runner would see
            # it both preempted and scheduled.
            if step.was_preempted(request) or not self._admit(request, step):
                break
            # Still the head: victims preempted for it had strictly lower priority.
            popped = self._waiting.pop()
            assert popped is request
            if request.lora_name is not None:
                adapters.add(request.lora_name)
        for request in reversed(passed):
            self._waiting.push_front(request)

    def _adapter_fits(self, lora_name: str | None, adapters: set[str]) -> bool:
        if lora_name is None or self.max_loras is None or lora_name in adapters:
            return True
        return len(adapters) < self.max_loras

    def _admit(self, request: Request, step: _StepPlan) -> bool:
        hit = self.block_manager.lookup_prefix(request.all_token_ids, request.lora_name)
        num_new = self._num_new_tokens(request, hit.num_tokens, step.budget)
        if num_new == 0 or not self._allocate_waiting(request, hit, num_new, step):
            return False
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens is None:
            self._count_prefix_hit(request, hit.num_tokens)
        self._running.append(request)
        step.add(request, num_new, self.block_manager.block_table(request.request_id))
        return True

    def _count_prefix_hit(self, request: Request, num_cached: int) -> None:
        request.num_cached_tokens = num_cached
        if self.block_manager.enable_prefix_caching:
            self.prefix_cache.queries += request.num_prompt_tokens
            self.prefix_cache.hits += num_cached

    def _allocate_waiting(
        self, request: Request, hit: PrefixHit, num_new: int, step: _StepPlan
    ) -> bool:
        # Preempting only frees blocks (into the evictable LRU), so `hit` stays valid meanwhile.
        num_tokens = hit.num_tokens + num_new
        bm = self.block_manager
        while not bm.allocate(request.request_id, num_tokens, hit, request.lora_name):
            victim = self._victim_for_waiting(request)
            if victim is None:
                return False
            self._preempt(victim, step)
        return True

    def _victim_for_waiting(self, request: Request) -> Request | None:
        """Under "priority", the lowest-priority running request if strictly below `request`."""
        if self.config.policy != "priority" or not self._running:
            return None
        victim = max(self._running, key=_preemption_key)
        return victim if victim.priority > request.priority else None

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute this step; 0 when a whole prefill is required and does not fit."""
        needed = request.num_tokens - num_computed
        if needed > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(needed, budget)

    def _preempt(self, victim: Request, step: _StepPlan) -> None:
        """Preemption by recompute: free everything, resume later from token 0."""
        self._running.remove(victim)
        self.block_manager.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.draft_token_ids = []
        victim.num_preemptions += 1
        self._waiting.push_front(victim)
        step.drop(victim)

    # -- update --------------------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[Request]:
        """Advances computed tokens, appends sampled tokens and applies the stop rules.

        Returns the requests that received a token this step, finished ones included, in chunk
        order. Requests finished (aborted) since `schedule()` are skipped.
        """
        sampled = dict(zip(runner_out.req_ids, runner_out.sampled_token_ids, strict=True))
        updated: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue
            if not chunk.samples:  # read before new tokens change num_tokens
                self._advance(request, chunk, chunk.start + chunk.num_tokens)
                continue
            tokens = sampled.get(request.request_id)
            assert tokens, f"no sampled token for {request.request_id}"
            stop = self._append(request, tokens)
            # The last appended token is not computed yet; accepted drafts before it are.
            self._advance(request, chunk, request.num_tokens - 1)
            updated.append(request)
            if stop is not None:
                request.stop_reason = stop[1]
                self._release(request, stop[0])
            elif chunk.draft_token_ids:
                # Rejected drafts' blocks go back; stale K/V left in a kept block lies past
                # num_computed_tokens, so it is rewritten before anything reads it.
                self.block_manager.trim(request.request_id, request.num_tokens)
        if any(r.is_finished for r in updated):
            self._running = [r for r in self._running if not r.is_finished]
        return updated

    def _advance(self, request: Request, chunk: ScheduledChunk, num_computed: int) -> None:
        assert chunk.start == request.num_computed_tokens, "update_from_output applied twice?"
        request.num_computed_tokens = num_computed
        bm = self.block_manager
        bm.cache_full_blocks(request.request_id, request.all_token_ids, num_computed)
        bm.release_out_of_window(request.request_id, num_computed)  # sliding windows only

    def _append(
        self, request: Request, tokens: list[int]
    ) -> tuple[RequestStatus, int | None] | None:
        """Appends the step's tokens (accepted drafts, then the sampled one) up to the first that
        ends the request (EOS, stop ids, length); the rest are discarded. Returns that stop."""
        for token in tokens:
            request.append_output_token(token)
            stop = check_stop(request, self.max_model_len)
            if stop is not None:
                return stop
        return None

    # -- finish from outside -------------------------------------------------------------------

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finishes requests from outside (abort, stop string) in any state; frees their blocks.

        Unknown and already finished ids are ignored. Returns the requests finished here.
        """
        assert status.finished, f"{status!r} is not a finished status"
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        finished: list[Request] = []
        for request_id in ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Takes an unfinished request out of running / waiting and releases it."""
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self._release(request, status)

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Terminal bookkeeping; the caller takes the request out of running / waiting."""
        request.status = status
        self.block_manager.free(request.request_id)
        del self._requests[request.request_id]
        self._deadlines.compact(len(self._requests))

    # -- validation ----------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt must have at least one token", param="prompt")
        if request.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        check_context_window(request.num_prompt_tokens, request.max_tokens, self.max_model_len)
        max_len = request.num_prompt_tokens + request.max_tokens
        # The last sampled token is never fed back, so K/V are needed for max_len - 1 tokens:
        # alone in the pool, the request then always fits and always makes progress.
        self._check_fits(max_len - 1)

    def _check_fits(self, max_kv_tokens: int) -> None:
        bm = self.block_manager
        # With sliding windows only the blocks in the window are held (block_manager.py).
        needed = bm.max_blocks_held(max_kv_tokens, self.config.max_num_batched_tokens)
        if needed > bm.num_blocks:
            raise InvalidRequestError(
                f"the request needs {needed * bm.block_size} KV cache slots; the pool has "
                f"{bm.num_blocks * bm.block_size}",
                param="max_tokens",
            )
        if not self.config.enable_chunked_prefill and max_kv_tokens > (
            self.config.max_num_batched_tokens
        ):
            raise InvalidRequestError(
                f"without chunked prefill a request must fit one step's "
                f"{self.config.max_num_batched_tokens} tokens; it may need {max_kv_tokens}",
                param="max_tokens",
            )


def check_stop(request: Request, max_model_len: int) -> tuple[RequestStatus, int | None] | None:
    """Status and stop_reason if the token just appended ends the request, else None.

    EOS (unless ignore_eos) and stop_token_ids stop the request, but not before `min_tokens`
    outputs; they win over the length limit when both apply to the same token. A grammar that
    accepted its stop token ends the request whatever `min_tokens` says: the answer is complete
    (that token, not one before it that the grammar accepted in the same step, with drafts).
    """
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if (
        request.grammar is not None
        and request.grammar.finished
        and token in request.eos_token_ids
        and not params.ignore_eos
    ):
        return RequestStatus.FINISHED_STOPPED, None
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def _is_unfinished(request: Request) -> bool:
    return not request.is_finished


def _preemption_key(request: Request) -> tuple[int, float]:
    # The largest key is preempted first: lowest priority (largest value), then newest.
    return request.priority, request.arrival_time


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and found there, since start (cumulative)."""

    queries: int = 0
    hits: int = 0


@dataclass
class _StepPlan:
    """The step being built: chunks by request id (in scheduling order) and the budget left."""

    budget: int
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)

    def add(
        self,
        request: Request,
        num_tokens: int,
        block_ids: list[int],
        drafts: list[int] | None = None,
    ) -> None:
        """`num_tokens` includes the `drafts` verified with the request's last token."""
        assert request.request_id not in self.chunks, "a request is scheduled once per step"
        chunk = ScheduledChunk(
            request, request.num_computed_tokens, num_tokens, block_ids, drafts or []
        )
        self.chunks[request.request_id] = chunk
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Records a preemption; a chunk the victim already got this step is returned."""
        chunk = self.chunks.pop(request.request_id, None)
        if chunk is not None:
            self.budget += chunk.num_tokens
        self.preempted_ids.append(request.request_id)

    def was_preempted(self, request: Request) -> bool:
        return request.request_id in self.preempted_ids

    def to_output(self) -> SchedulerOutput:
        chunks = list(self.chunks.values())
        return SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=sum(c.num_tokens for c in chunks),
            preempted_ids=self.preempted_ids,
        )
