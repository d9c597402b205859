"""The stream side of the server's engine client: one RequestStream per accepted request.

The reader hands every DELTA output the core sends to `StreamTable.dispatch`, which merges it
into its stream's pending delta (text appended, token ids and logprobs extended) and wakes the
stream's generator. A slow consumer only grows its own pending delta; past
`max_pending_output_tokens` unread tokens its request fails with OutputBacklogError and
`dispatch` says to abort it in the engine. A request whose deadline passed before its first
token (status FINISHED_EXPIRED_WAITING) fails with QueueTimeoutError instead of delivering an
empty completion.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from inferd.engine.generate_request import GenerateRequest
from inferd.engine.messages import RejectedRequest
from inferd.errors import InferdError, InvalidRequestError, OutputBacklogError, QueueTimeoutError
from inferd.telemetry.timeline import RequestTimeline
from inferd.types import CompletionOutput, RequestOutput, RequestStatus

QUEUE_TIMEOUT_MESSAGE = "the request's deadline passed before it was scheduled"


@dataclass(eq=False)
class RequestStream:
    """One accepted request, as its generator and the reader share it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: RequestOutput | None = None
    pending_tokens: int = 0
    error: BaseException | None = None
    done: bool = False  # a finished output or an error is recorded; nothing more will come
    in_engine: bool = False
    num_yielded: int = 0
    timeline: RequestTimeline | None = None

    def deliver(self, out: RequestOutput) -> None:
        self.pending_tokens += sum(len(c.token_ids) for c in out.outputs)
        if self.pending is None:
            self.pending = out
        else:
            _merge(self.pending, out)
        self.done = self.done or out.finished
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self.done = True
            self.event.set()

    async def next(self) -> RequestOutput:
        """The next coalesced delta; pending output is delivered before a recorded error."""
        while True:
            out = self.pending
            if out is not None:
                self.pending, self.pending_tokens = None, 0
                self._complete(out)
                return out
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()

    def _complete(self, out: RequestOutput) -> None:
        self.num_yielded += 1
        if self.timeline is not None:
            self.timeline.update_from_engine(out.metrics, self.request_id)
        # The engine core sends neither the prompt nor its ids back (the front has both).
        if out.prompt is None:
            out.prompt = self.prompt
        if not out.prompt_token_ids:
            out.prompt_token_ids = self.prompt_token_ids


class StreamTable:
    """The accepted, unfinished requests by id."""

    def __init__(self, max_pending_output_tokens: int) -> None:
        self.max_pending_output_tokens = max_pending_output_tokens
        self._streams: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._streams))

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def open(self, request: GenerateRequest) -> RequestStream:
        if request.request_id in self._streams:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in flight", "id"
            )
        stream = RequestStream(
            request.request_id,
            request.prompt,
            list(request.prompt_token_ids),
            timeline=request.timeline,
        )
        self._streams[request.request_id] = stream
        return stream

    def close(self, stream: RequestStream) -> bool:
        """Forgets `stream`; False if it was already gone (finished, failed or replaced)."""
        if self._streams.get(stream.request_id) is not stream:
            return False
        del self._streams[stream.request_id]
        return True

    def pop(self, request_id: str) -> RequestStream | None:
        return self._streams.pop(request_id, None)

    def dispatch(self, out: RequestOutput) -> bool:
        """Routes one engine output to its stream; True if the request must now be aborted in
        the engine (its reader fell too far behind)."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return False
        if out.finished:
            del self._streams[stream.request_id]
            if _expired_waiting(out) and stream.num_yielded == 0 and stream.pending is None:
                stream.fail(QueueTimeoutError(QUEUE_TIMEOUT_MESSAGE))
                return False
        stream.deliver(out)
        if stream.pending_tokens <= self.max_pending_output_tokens or out.finished:
            return False
        del self._streams[stream.request_id]
        stream.pending = None
        stream.fail(
            OutputBacklogError(
                f"the client read too slowly: more than {self.max_pending_output_tokens} "
                "output tokens were waiting unread, so the request was aborted"
            )
        )
        return True

    def reject(self, rejected: RejectedRequest) -> None:
        stream = self._streams.pop(rejected.request_id, None)
        if stream is not None:
            stream.fail(_rejection_error(rejected))

    def fail(self, request_id: str, error: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(error)

    def fail_all(self, error: Exception) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.fail(error)


def _merge(into: RequestOutput, new: RequestOutput) -> None:
    """Coalesces delta `new` into the unread delta `into` (same request, later step)."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
        else:
            _merge_choice(old, c)
    into.finished = new.finished
    into.metrics = new.metrics


def _merge_choice(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
    old.cumulative_logprob = new.cumulative_logprob
    old.status = new.status


def _expired_waiting(out: RequestOutput) -> bool:
    """The engine says the request's deadline passed before its first token (a queue timeout)."""
    return all(c.status is RequestStatus.FINISHED_EXPIRED_WAITING for c in out.outputs)


def _rejection_error(rejected: RejectedRequest) -> Exception:
    if rejected.error_type == "invalid_request":
        return InvalidRequestError(rejected.message, rejected.param)
    return InferdError(f"the engine could not take the request: {rejected.message}")
