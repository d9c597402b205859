"""The image engine's step loop, on its own thread in the server process.

    core = ImageEngineCore(runner, limits, styles)  # styles: UNetStyles, None without LoRA
    core.set_emit(emit)                            # emit(request_id, event or error)
    core.add(request, spec)                        # QueueFullError (429) at the queue's bound
    threading.Thread(target=core.run).start()
    core.abort(request_id)                         # a client went away
    core.call(lambda styles: styles.register(r))   # any thread: runs on the engine thread

One step, and the whole loop is this:

    styles  (LoRA on) the calls other threads queued on the styles run; finished style reads
            go into host memory (`take_loaded`, pinning the styles of unfinished requests)
    drop    requests aborted or past their deadline (queued or admitted; their latents go)
    admit   pop the admission queue (priority, then arrival) while fewer than `max_admitted`
            requests are admitted (one whose style is being read waits aside, its `lora_load`
            time; a refused file fails it, 400); prompts go through the text encoder together
    plan    the step policy (step_scheduler.py) picks one bucket and its rows (<= max_loras styles)
    denoise one UNet forward over those rows, each request at its own timestep and style
            (`set_rows`: a request's uncond and cond rows both run its style); progress events
    finish  requests past their last step: VAE decode in batches of `max_decode_rows`

A failure inside a stage fails only the requests that stage ran (each gets an `InferdError`),
never the loop. torch releases the GIL inside its ops, so the event loop keeps serving HTTP while
a forward runs. Shared state (the queue, the abort set) is touched under one lock; everything
else belongs to the engine thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inferd.admission.queue import AdmissionQueue
from inferd.admission.retry_after import CompletionRate
from inferd.diffusion.denoise import DenoiseState, denoise_step, start_states
from inferd.diffusion.request import (
    DenoiseProgress,
    ImageEngineStats,
    ImageEvent,
    ImageRequest,
    ImagesDone,
)
from inferd.diffusion.runner import ImageRunner
from inferd.diffusion.step_scheduler import Slot, StepPolicy
from inferd.diffusion.validate import MAX_N, ImageSpec
from inferd.errors import (
    DeadlineExceededError,
    DrainingError,
    EngineDeadError,
    InferdError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
)
from inferd.telemetry.stages import Stage

if TYPE_CHECKING:
    from inferd.diffusion.lora import UNetStyles
    from inferd.lora.adapter import LoRAAdapter

logger = logging.getLogger("inferd.diffusion")

Emit = Callable[[str, "ImageEvent | BaseException"], None]


@dataclass(frozen=True)
class CoreLimits:
    max_rows_per_step: int
    max_admitted: int
    max_queued_requests: int
    max_decode_rows: int


@dataclass
class _Queued:
    request: ImageRequest
    spec: ImageSpec
    seq: int
    enqueued_at: float


@dataclass
class _StyleWait:
    """A popped request whose style is being read into host memory."""

    item: _Queued
    read: concurrent.futures.Future[LoRAAdapter]
    since: float


StyleCall = Callable[["UNetStyles"], Any]


class ImageEngineCore:
    def __init__(
        self, runner: ImageRunner, limits: CoreLimits, styles: UNetStyles | None = None
    ) -> None:
        self.runner = runner
        self.limits = limits
        self.styles = styles
        max_loras = None if styles is None else styles.max_loras
        self.policy = StepPolicy(limits.max_rows_per_step, max_loras)
        # The served style names, republished by the engine thread after every change (so
        # other threads read them without touching the styles).
        self.style_names: tuple[str, ...] = self._known_styles()
        self._calls: list[tuple[StyleCall, concurrent.futures.Future[Any]]] = []
        self._style_waits: dict[str, _StyleWait] = {}
        # The styles of queued requests (by request id; pruned each step): a style unloaded
        # while requests of it wait in the queue stays in host memory for them.
        self._queued_styles: dict[str, str] = {}
        self._emit: Emit = _nowhere
        self._lock = threading.Condition()
        # The queue's second bound counts images (n each); the request bound is the one that
        # binds, since no request has more than MAX_N images.
        self._queue: AdmissionQueue[_Queued] = AdmissionQueue(
            limits.max_queued_requests, limits.max_queued_requests * MAX_N
        )
        self._aborted: set[str] = set()
        self._admitted: dict[str, DenoiseState] = {}
        self._seq = itertools.count()
        self._completions = CompletionRate(256)
        self._stopping = False
        self._closed: InferdError | None = None  # set once the loop ended: add() refuses
        self._counts = {"images": 0, "requests": 0, "forwards": 0, "rows": 0, "steps": 0}

    def set_emit(self, emit: Emit) -> None:
        """Where events go (`emit(request_id, event or error)`, called on the engine thread);
        set before the thread starts."""
        self._emit = emit

    # -- any thread ----------------------------------------------------------------------------

    def add(self, request: ImageRequest, spec: ImageSpec) -> None:
        """Queues a checked request, or raises QueueFullError with its Retry-After hint."""
        now = time.monotonic()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            item = _Queued(request, spec, next(self._seq), now)
            try:
                self._queue.push(
                    request.request_id,
                    item,
                    num_prompt_tokens=spec.n,
                    priority=request.priority,
                    deadline=request.deadline,
                )
            except QueueFullError as e:
                e.retry_after = self._completions.retry_after(len(self._queue))
                raise
            if spec.lora_name is not None:
                self._queued_styles[request.request_id] = spec.lora_name
            self._lock.notify()

    def call(self, fn: StyleCall) -> concurrent.futures.Future[Any]:
        """Runs `fn(styles)` on the engine thread (whose the styles are) at its next step."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.styles is None:
                raise InvalidRequestError("this image model serves no styles (--enable-lora)")
            if self._closed is not None:
                raise self._closed
            self._calls.append((fn, future))
            self._lock.notify()
        return future

    def abort(self, request_id: str) -> None:
        """The request leaves at the next step boundary (at once if it is still queued)."""
        with self._lock:
            if self._queue.remove(request_id) is None:
                self._aborted.add(request_id)
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def stats(self) -> ImageEngineStats:
        c = self._counts
        return ImageEngineStats(
            running=len(self._admitted),
            waiting=len(self._queue) + len(self._style_waits),
            images_total=c["images"],
            requests_total=c["requests"],
            unet_forwards_total=c["forwards"],
            unet_rows_total=c["rows"],
            denoise_steps_total=c["steps"],
        )

    def idle(self) -> bool:
        with self._lock:
            return not self._admitted and not self._style_waits and len(self._queue) == 0

    # -- the engine thread ---------------------------------------------------------------------

    def run(self) -> None:
        """Steps until `stop()`; sleeps while there is no work. When it ends (stopped, or a bug
        escaped a step), whatever is queued or admitted fails and nothing more is accepted."""
        error: InferdError = DrainingError("the image engine stopped")
        try:
            while self._wait_for_work():
                self.step()
        except Exception as e:
            logger.exception("the image engine loop died")
            error = EngineDeadError(f"the image engine died: {e}")
        finally:
            with self._lock:
                self._closed = error
            self._fail_all(error)

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._stopping and not self._has_work():
                wait = self._queue.time_to_next_deadline(time.monotonic())
                self._lock.wait(timeout=None if math.isinf(wait) else wait)
                self._expire_queued(time.monotonic())
            return not self._stopping

    def _has_work(self) -> bool:
        """Caller holds the lock. Style waits are work once a read ended."""
        if self._admitted or self._calls or any(w.read.done() for w in self._style_waits.values()):
            return True
        return len(self._queue) > 0 and len(self._style_waits) < self.limits.max_admitted

    def step(self) -> None:
        now = time.monotonic()
        self._update_styles()
        self._drop(now)
        self._admit(now)
        plan = self.policy.plan(self._slots())
        if plan is not None:
            self._denoise([self._admitted[rid] for rid in plan.request_ids])
        self._finish()

    def _slots(self) -> list[Slot]:
        return [
            Slot(
                rid,
                (s.spec.width, s.spec.height),
                s.rows,
                s.request.priority,
                s.seq,
                s.spec.lora_name,
            )
            for rid, s in self._admitted.items()
        ]

    # -- styles --------------------------------------------------------------------------------

    def _update_styles(self) -> None:
        styles = self.styles
        if styles is None:
            return
        with self._lock:
            calls, self._calls = self._calls, []
            queued = {r: s for r, s in self._queued_styles.items() if r in self._queue}
            self._queued_styles = queued
        for fn, future in calls:
            try:
                result = fn(styles)
            except Exception as e:
                self.style_names = self._known_styles()
                future.set_exception(e)
            else:  # the names first: whoever waits on the call may read them at once
                self.style_names = self._known_styles()
                future.set_result(result)
        in_use = {s.spec.lora_name for s in self._admitted.values()} | set(queued.values())
        in_use |= {w.item.spec.lora_name for w in self._style_waits.values()}
        styles.take_loaded(in_use=[name for name in in_use if name is not None])
        self.style_names = self._known_styles()

    def _known_styles(self) -> tuple[str, ...]:
        return () if self.styles is None else tuple(r.lora_name for r in self.styles.known())

    def _ready(self, popped: list[_Queued], now: float) -> list[_Queued]:
        """The popped requests whose style is in host memory, and those whose read just
        finished; the others wait aside while theirs is read (a refused file fails them)."""
        styles = self.styles
        if styles is None:
            return popped  # no request names a style: validate.py refused them
        ready = []
        for q in popped:
            name = q.spec.lora_name
            if name is None or styles.is_loaded(name):
                if name is not None:
                    styles.load(name)  # marks it recently used
                ready.append(q)
            elif styles.get(name) is None:
                self._fail(q.request, ModelNotFoundError(f"the style {name!r} is not served now"))
            else:
                read = styles.load(name)
                self._style_waits[q.request.request_id] = _StyleWait(q, read, now)
                read.add_done_callback(lambda _: self._wake())
        for rid, wait in list(self._style_waits.items()):
            name = wait.item.spec.lora_name
            assert name is not None
            error = wait.read.exception() if wait.read.done() else None
            if error is None and not styles.is_loaded(name):
                continue  # still reading, or read but not yet taken into host memory
            del self._style_waits[rid]
            if error is not None:
                self.style_names = self._known_styles()  # a refused style is unregistered
                self._fail(wait.item.request, error)
                continue
            wait.item.request.timings.add(Stage.LORA_LOAD, now - wait.since, wait.since)
            ready.append(wait.item)
        return ready

    def _drop(self, now: float) -> None:
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            self._expire_queued(now)
        for rid in aborted:
            if (self._admitted.pop(rid, None) or self._style_waits.pop(rid, None)) is not None:
                self._count_finish(0)
        for rid, wait in list(self._style_waits.items()):
            if (deadline := wait.item.request.deadline) is not None and deadline <= now:
                del self._style_waits[rid]
                self._fail(wait.item.request, QueueTimeoutError("it waited past its deadline"))
        for rid, state in list(self._admitted.items()):
            deadline = state.request.deadline
            if deadline is not None and deadline <= now:
                del self._admitted[rid]
                self._fail(
                    state.request,
                    DeadlineExceededError(
                        f"the request's deadline passed after {state.step_index} of "
                        f"{state.num_steps} denoising steps"
                    ),
                )

    def _expire_queued(self, now: float) -> None:
        """Caller holds the lock."""
        for entry in self._queue.expire(now):
            self._fail(
                entry.item.request, QueueTimeoutError("the request waited past its deadline")
            )

    def _admit(self, now: float) -> None:
        room = self.limits.max_admitted - len(self._admitted) - len(self._style_waits)
        popped: list[_Queued] = []
        with self._lock:
            while len(popped) < room and (entry := self._queue.pop()) is not None:
                popped.append(entry.item)
        for item in popped:
            item.request.timings.add(Stage.QUEUE, now - item.enqueued_at, item.enqueued_at)
        popped = self._ready(popped, now)
        if not popped:
            return
        t0 = time.monotonic()
        try:
            states = start_states(self.runner, [(q.request, q.spec, q.seq) for q in popped])
        except Exception as e:
            logger.exception("text encoding failed")
            for item in popped:
                self._fail(item.request, InferdError(f"text encoding failed: {e}"))
            return
        elapsed = time.monotonic() - t0
        for state in states:
            state.request.timings.add(Stage.TEXT_ENCODE, elapsed, t0)
            state.admitted_at = t0 + elapsed
            self._admitted[state.request.request_id] = state

    def _denoise(self, states: list[DenoiseState]) -> None:
        t0 = time.monotonic()
        for s in states:
            if s.first_step_at is None:
                s.first_step_at = t0
                # Admitted but not yet picked (the budget was full): that wait is queueing too.
                s.request.timings.add(Stage.QUEUE, t0 - s.admitted_at)
        try:
            if self.styles is not None:
                self.styles.set_rows([(s.spec.lora_name, s.rows) for s in states])
            denoise_step(self.runner, states)
        except Exception as e:
            logger.exception("a denoising step failed")
            for s in states:
                self._admitted.pop(s.request.request_id, None)
                self._fail(s.request, InferdError(f"denoising failed: {e}"))
            return
        c = self._counts
        c["forwards"] += 1
        c["rows"] += sum(s.rows for s in states)
        c["steps"] += len(states)
        self._progress(states)

    def _progress(self, states: list[DenoiseState]) -> None:
        """A progress event per request; those at a preview step get the decoded latents."""
        previews = [s for s in states if s.step_index in s.preview_steps]
        pixels = None
        if previews:
            latents = [s.latents if s.denoised is None else s.denoised for s in previews]
            try:
                pixels = self.runner.decode(torch.cat(latents))
            except Exception:
                logger.exception("a preview decode failed")
        offsets, start = {}, 0
        for s in previews:
            offsets[s.request.request_id] = start
            start += s.spec.n
        for s in states:
            rid = s.request.request_id
            event = DenoiseProgress(s.step_index, s.num_steps)
            if pixels is not None and rid in offsets:
                index = s.preview_steps.index(s.step_index)
                preview = pixels[offsets[rid] : offsets[rid] + s.spec.n]
                event = DenoiseProgress(s.step_index, s.num_steps, preview, index)
            self._emit(rid, event)

    def _finish(self) -> None:
        done = [s for s in self._admitted.values() if s.done]
        if not done:
            return
        for s in done:
            del self._admitted[s.request.request_id]
            assert s.first_step_at is not None
            s.request.timings.add(
                Stage.DENOISE, time.monotonic() - s.first_step_at, s.first_step_at
            )
        for group in _decode_groups(done, self.limits.max_decode_rows):
            self._decode(group)

    def _decode(self, group: list[DenoiseState]) -> None:
        t0 = time.monotonic()
        try:
            pixels = self.runner.decode(torch.cat([s.latents for s in group]))
        except Exception as e:
            logger.exception("VAE decode failed")
            for s in group:
                self._fail(s.request, InferdError(f"VAE decode failed: {e}"))
            return
        elapsed = time.monotonic() - t0
        start = 0
        for s in group:
            s.request.timings.add(Stage.VAE_DECODE, elapsed, t0)
            images = pixels[start : start + s.spec.n]
            start += s.spec.n
            self._count_finish(s.spec.n)
            self._emit(s.request.request_id, ImagesDone(images, s.spec.seed, s.request.timings))

    def _fail(self, request: ImageRequest, error: BaseException) -> None:
        self._count_finish(0)
        self._emit(request.request_id, error)

    def _count_finish(self, images: int) -> None:
        self._counts["requests"] += 1
        self._counts["images"] += images
        self._completions.record(time.monotonic())

    def _fail_all(self, error: InferdError) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            queued = []
            while (entry := self._queue.pop()) is not None:
                queued.append(entry.item.request)
        waits = [w.item.request for w in self._style_waits.values()]
        for request in [*queued, *waits, *(s.request for s in self._admitted.values())]:
            # One instance each: every stream raises its own (a shared one would share its
            # traceback across the requests' tasks).
            self._fail(request, type(error)(str(error)))
        self._admitted.clear()
        self._style_waits.clear()
        for _, future in calls:
            future.set_exception(error)


def _decode_groups(states: list[DenoiseState], max_rows: int) -> list[list[DenoiseState]]:
    """Consecutive groups of at most `max_rows` images (a request larger than that alone; the
    runner splits its latents itself)."""
    groups: list[list[DenoiseState]] = []
    rows = 0
    for s in states:
        if not groups or rows + s.spec.n > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(s)
        rows += s.spec.n
    return groups


def _nowhere(request_id: str, item: ImageEvent | BaseException) -> None:
    """The emit of a core nobody listens to yet."""
