"""Invariants of the scheduler and block manager over random workloads (hypothesis).

A faked model plays the runner: it writes, for every scheduled position, the exact token prefix
that position's K/V would encode into the slot the block table names, then checks that every
position a chunk attends to holds its own prefix. So a wrong block table, a prefix hit on the
wrong block, or a block reused while still referenced shows up as a wrong "K/V" read. Requests
run under random LoRA adapters (or the base model), whose K/V differ for the same tokens: the slot
holds the adapter too, so a prefix hit across adapters is a wrong read as well, and no step runs
more than `max_loras` distinct adapters.

Speculative decoding: in workloads with `draft_len`, every decoding request gets drafts before
each step, right up to a position that varies by request and step and wrong after it. The fake
runner writes the drafts' K/V too and accepts the drafts that equal the model's tokens, so K/V of
rejected drafts left in the cache, a block cached with them, or a block leaked by the rollback
shows up as a wrong read, a wrong output or a leak.

Sliding windows: in workloads with `window` W (a model whose every layer has one), a chunk reads
only the positions of its queries' windows, from its start - W + 1 on, and the block manager
releases the blocks wholly before that. The fake runner checks that every position it reads is
present and right, that every released entry lies wholly before the chunk's window (so none is
read), and that a request holds no more blocks than the window bound (`max_blocks_held`); pools
are then sized by that bound, smaller than the longest request's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.config import SchedulerConfig
from inferd.kv_cache.block_manager import OUT_OF_WINDOW, BlockManager
from inferd.sampling.params import SamplingParams
from inferd.scheduler.output import ScheduledChunk, SchedulerOutput
from inferd.scheduler.request import Request, RequestStatus
from inferd.scheduler.scheduler import Scheduler
from inferd.scheduler.step_budget import StepBudget
from inferd.types import ModelRunnerOutput

EOS = 0
VOCAB = 11  # small, so EOS and stop tokens come up often
MAX_STEPS = 5000


def model_token(seed: int, position: int) -> int:
    """The faked model's sample at `position`: a function of the request and position only."""
    return (seed * 7919 + position * 104729 + (seed ^ position) * 31) % VOCAB


@dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_ids: tuple[int, ...]
    priority: int
    arrival_step: int
    abort_step: int | None
    abort_after_run: bool  # abort between schedule() and update_from_output()
    lora: str | None = None  # the adapter it runs under; None: the base model


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_blocks: int
    budget: int
    max_seqs: int
    chunked: bool
    policy: str
    prefix: bool
    # Faked seconds per scheduled prompt token, driving the step-time budget; None: fixed budget.
    seconds_per_token: float | None
    specs: tuple[Spec, ...]
    # Distinct adapters a step may run; None: LoRA off.
    max_loras: int | None = None
    # Drafts proposed per decoding request and step (speculative decoding); 0: none.
    draft_len: int = 0
    # Every layer's sliding window (the block manager releases blocks before it); None: none.
    window: int | None = None


def expected(spec: Spec, seed: int) -> tuple[list[int], RequestStatus, int | None]:
    """What the stop rules imply for this request, by a plain walk over the model's tokens."""
    out: list[int] = []
    for k in range(1, spec.max_tokens + 1):
        token = model_token(seed, len(spec.prompt) + k - 1)
        out.append(token)
        if k >= spec.min_tokens and not spec.ignore_eos and token == EOS:
            return out, RequestStatus.FINISHED_STOPPED, None
        if k >= spec.min_tokens and token in spec.stop_ids:
            return out, RequestStatus.FINISHED_STOPPED, token
    return out, RequestStatus.FINISHED_LENGTH, None


@st.composite
def specs(draw: st.DrawFn, families: list[list[int]]) -> Spec:
    family = draw(st.sampled_from(families))
    shared = draw(st.integers(0, len(family)))
    suffix = draw(st.lists(st.integers(1, 50), max_size=12))
    prompt = tuple(family[:shared] + suffix) or (7,)
    max_tokens = draw(st.integers(1, 10))
    abort_step = draw(st.none() | st.integers(0, 40))
    return Spec(
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        stop_ids=tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=2))),
        priority=draw(st.integers(0, 2)),
        arrival_step=draw(st.integers(0, 12)),
        abort_step=abort_step,
        abort_after_run=draw(st.booleans()),
        lora=draw(st.sampled_from([None, "x", "y", "z"])),
    )


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    families = draw(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=20), min_size=1))
    reqs = tuple(draw(st.lists(specs(families), min_size=1, max_size=8)))
    block_size = draw(st.integers(1, 4))
    chunked = draw(st.booleans())
    # Size the pool and budget so every request fits alone (add_request rejects the rest);
    # a small surplus keeps the pool tight enough to force preemption.
    max_kv = max(len(s.prompt) + s.max_tokens - 1 for s in reqs)
    budget = draw(st.integers(1, 24))
    budget = budget if chunked else max(budget, max_kv)
    window = draw(st.none() | st.integers(1, 8))
    # With a window a request holds only the blocks its window and chunk need.
    min_blocks = BlockManager(1, block_size, window=window).max_blocks_held(max_kv, budget)
    return Workload(
        block_size=block_size,
        num_blocks=min_blocks + draw(st.integers(0, 6)),
        budget=budget,
        max_seqs=draw(st.integers(1, 5)),
        chunked=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        prefix=draw(st.booleans()),
        seconds_per_token=draw(st.none() | st.floats(1e-4, 0.1)),
        specs=reqs,
        max_loras=draw(st.none() | st.integers(1, 2)),
        draft_len=draw(st.sampled_from([0, 0, 1, 3])),
        window=window,
    )


class FakeRunner:
    """Writes each position's prefix into its slot, checks every read, samples model_token."""

    def __init__(self, bm: BlockManager, window: int | None = None) -> None:
        self.bm = bm
        self.window = window
        # (block, offset) -> the adapter and token prefix the K/V written there encode.
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}
        self.seeds: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.bm.block_size
        # Every chunk's K/V are written before any chunk reads, as within one layer of the runner.
        for c in out.chunks:
            tokens = c.request.all_token_ids[: c.start] + c.token_ids()
            for p in range(c.start, c.start + c.num_tokens):
                block = c.block_ids[p // bs]
                assert block != OUT_OF_WINDOW, "writing into a released entry"
                assert self.bm.ref_count(block) == 1, "writing into a shared block"
                self.slots[(block, p % bs)] = (c.request.lora_name, tuple(tokens[: p + 1]))
        for c in out.chunks:
            tokens = c.request.all_token_ids[: c.start] + c.token_ids()
            # The first position any query of the chunk sees (p sees p - W + 1 .. p).
            lo = 0 if self.window is None else max(0, c.start - self.window + 1)
            released = [i for i, b in enumerate(c.block_ids) if b == OUT_OF_WINDOW]
            assert all((i + 1) * bs <= lo for i in released), "a block in the window released"
            held = len(c.block_ids) - len(released)
            assert held <= self.bm.max_blocks_held(c.start + c.num_tokens, c.num_tokens)
            for p in range(lo, c.start + c.num_tokens):
                assert self.bm.ref_count(c.block_ids[p // bs]) > 0, "reading a free block"
                got = self.slots.get((c.block_ids[p // bs], p % bs))
                want = (c.request.lora_name, tuple(tokens[: p + 1]))
                assert got == want, f"wrong K/V at {p} for {c.request}"
        sampling = [c for c in out.chunks if c.samples]
        return ModelRunnerOutput(
            req_ids=[c.request.request_id for c in sampling],
            sampled_token_ids=[self.verify(c) for c in sampling],
        )

    def verify(self, c: ScheduledChunk) -> list[int]:
        """The drafts equal to the model's tokens at their positions, then the model's token."""
        seed, first = self.seeds[c.request.request_id], c.request.num_tokens
        out = []
        for i, draft in enumerate([*c.draft_token_ids, None]):
            token = model_token(seed, first + i)
            out.append(token)
            if draft != token:
                return out
        raise AssertionError("unreachable: the last row has no draft")

    def propose(self, s: Scheduler, draft_len: int, step: int) -> None:
        """Drafts for each decoding request: the model's tokens, wrong from a varying index."""
        for r in s.running_requests():
            seed, first = self.seeds[r.request_id], r.num_tokens
            right = (seed + step) % (draft_len + 1)
            r.draft_token_ids = [
                model_token(seed, first + i) + (0 if i < right else 1) for i in range(draft_len)
            ]


def make_request(i: int, spec: Spec) -> Request:
    params = SamplingParams(
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_ids),
    )
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=list(spec.prompt),
        sampling_params=params,
        max_tokens=spec.max_tokens,
        eos_token_ids=frozenset({EOS}),
        arrival_time=spec.arrival_step + i * 1e-3,
        priority=spec.priority,
        lora_name=spec.lora,
    )


def check_step(w: Workload, s: Scheduler, out: SchedulerOutput) -> None:
    bm = s.block_manager
    ids = [c.request.request_id for c in out.chunks]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert not set(ids) & set(out.preempted_ids)
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks) <= w.budget
    assert len(out.chunks) <= w.max_seqs and s.num_running <= w.max_seqs
    adapters = {c.request.lora_name for c in out.chunks} - {None}
    assert w.max_loras is None or len(adapters) <= w.max_loras
    for c in out.chunks:
        assert c.num_tokens >= 1 and c.start == c.request.num_computed_tokens
        assert c.start + c.num_tokens <= c.request.num_tokens + c.num_drafts
        assert not c.num_drafts or c.samples, "drafts on a chunk that does not sample"
        assert len(c.block_ids) * bm.block_size >= c.start + c.num_tokens
        assert c.block_ids == bm.block_table(c.request.request_id)
        assert w.chunked or c.samples, "a prefill was chunked with chunked prefill off"
    bm.check_invariants()


def run(w: Workload) -> tuple[list[Request], BlockManager]:
    config = SchedulerConfig(
        max_num_batched_tokens=w.budget,
        max_num_seqs=w.max_seqs,
        enable_chunked_prefill=w.chunked,
        policy=w.policy,  # type: ignore[arg-type]
    )
    bm = BlockManager(w.num_blocks, w.block_size, w.prefix, window=w.window)
    s = Scheduler(config, bm, max_model_len=10_000, max_loras=w.max_loras)
    if w.seconds_per_token is not None and w.chunked:
        # Budgets that change from step to step, down to 1 token.
        s.step_budget = StepBudget(w.budget, target_s=0.05, min_tokens=1)
    runner = FakeRunner(bm, w.window)
    reqs = [make_request(i, spec) for i, spec in enumerate(w.specs)]
    runner.seeds = {r.request_id: i for i, r in enumerate(reqs)}
    for t in range(MAX_STEPS):
        if t > max(sp.arrival_step for sp in w.specs) and not s.has_unfinished_requests():
            return reqs, bm
        for r, spec in zip(reqs, w.specs, strict=True):
            if spec.arrival_step == t:
                s.add_request(r)
        due = [
            (r.request_id, sp.abort_after_run)
            for r, sp in zip(reqs, w.specs, strict=True)
            if sp.abort_step == t
        ]
        late = [rid for rid, after_run in due if after_run]
        s.finish_requests(
            [rid for rid, after_run in due if not after_run], RequestStatus.FINISHED_ABORTED
        )
        if w.draft_len:
            runner.propose(s, w.draft_len, t)
        out = s.schedule()
        check_step(w, s, out)
        runner_out = runner.execute(out)
        s.finish_requests(late, RequestStatus.FINISHED_ABORTED)
        updated = s.update_from_output(out, runner_out)
        assert all(r.status is not RequestStatus.FINISHED_ABORTED for r in updated)
        for r in s.running_requests():
            held = len(bm.block_table(r.request_id))
            assert held <= bm.num_blocks_for(r.num_tokens), "rejected drafts' blocks kept"
        prompt = sum(
            c.num_tokens for c in out.chunks if not c.samples or c.num_tokens > 1 + c.num_drafts
        )
        s.step_budget.observe(prompt, 0.01 + prompt * (w.seconds_per_token or 0.0))
        bm.check_invariants()
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def check_final(w: Workload, reqs: list[Request]) -> None:
    for i, (r, spec) in enumerate(zip(reqs, w.specs, strict=True)):
        tokens, status, reason = expected(spec, i)
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == tokens[: r.num_output_tokens]
            continue
        assert r.output_token_ids == tokens
        assert (r.status, r.stop_reason) == (status, reason)


@settings(max_examples=250, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant(w: Workload) -> None:
    reqs, bm = run(w)
    check_final(w, reqs)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
