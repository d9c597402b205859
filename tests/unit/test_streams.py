"""The engine client's stream side without a process: how the core's finish statuses reach the
caller (queue timeout vs generation timeout), delta merging, the unread-output bound."""

from __future__ import annotations

import asyncio

import pytest

from inferd.engine.generate_request import GenerateRequest
from inferd.engine.streams import RequestStream, StreamTable
from inferd.errors import OutputBacklogError, QueueTimeoutError
from inferd.sampling.params import SamplingParams
from inferd.types import CompletionOutput, RequestMetrics, RequestOutput, RequestStatus


def output(
    rid: str, ids: list[int], status: RequestStatus | None = None, n: int = 1
) -> RequestOutput:
    choices = [
        CompletionOutput(
            index=i,
            text="x" * len(ids),
            token_ids=list(ids),
            finish_reason=None if status is None else status.finish_reason,
            status=status,
        )
        for i in range(n)
    ]
    return RequestOutput(rid, None, [], choices, status is not None, RequestMetrics(0.0))


def open_stream(table: StreamTable, rid: str = "r") -> RequestStream:
    return table.open(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8), prompt="p"))


def test_expiry_before_the_first_token_is_a_queue_timeout() -> None:
    table = StreamTable(max_pending_output_tokens=100)
    stream = open_stream(table)
    assert table.dispatch(output("r", [], RequestStatus.FINISHED_EXPIRED_WAITING, n=2)) is False
    assert "r" not in table
    with pytest.raises(QueueTimeoutError):
        asyncio.run(stream.next())


def test_a_generation_timeout_is_a_finished_output() -> None:
    table = StreamTable(max_pending_output_tokens=100)
    stream = open_stream(table)
    table.dispatch(output("r", [7]))
    table.dispatch(output("r", [8], RequestStatus.FINISHED_TIMEOUT))
    out = asyncio.run(stream.next())
    (choice,) = out.outputs
    assert out.finished and choice.token_ids == [7, 8] and choice.text == "xx"
    assert choice.finish_reason == "timeout" and choice.status is RequestStatus.FINISHED_TIMEOUT
    assert out.prompt == "p" and out.prompt_token_ids == [1, 2, 3]


def test_mixed_choices_are_not_a_queue_timeout() -> None:
    table = StreamTable(max_pending_output_tokens=100)
    stream = open_stream(table)
    out = output("r", [], RequestStatus.FINISHED_EXPIRED_WAITING, n=2)
    out.outputs[0].status = RequestStatus.FINISHED_TIMEOUT
    table.dispatch(out)
    assert asyncio.run(stream.next()).finished


def test_an_unread_backlog_past_the_bound_fails_the_stream_and_asks_for_an_abort() -> None:
    table = StreamTable(max_pending_output_tokens=3)
    stream = open_stream(table)
    assert table.dispatch(output("r", [1, 2])) is False
    assert table.dispatch(output("r", [3, 4])) is True
    assert "r" not in table
    with pytest.raises(OutputBacklogError):
        asyncio.run(stream.next())


def test_duplicate_ids_are_refused_and_close_is_idempotent() -> None:
    table = StreamTable(max_pending_output_tokens=3)
    stream = open_stream(table)
    with pytest.raises(ValueError):
        open_stream(table)
    assert table.close(stream) is True and table.close(stream) is False
