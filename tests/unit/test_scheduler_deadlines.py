"""Deadlines are the scheduler's: expiry before the first token vs a generation timeout."""

from __future__ import annotations

from test_scheduler import make_request, make_scheduler, step

from inferd.scheduler.request import RequestStatus


def test_a_waiting_request_past_its_deadline_expires_waiting() -> None:
    s = make_scheduler(max_seqs=1)
    running = make_request("running", 4, max_tokens=50)
    late = make_request("late", 4)
    late.deadline = 10.0
    s.add_request(running)
    s.add_request(late)
    step(s)  # one sequence slot: "late" keeps waiting
    assert s.next_deadline() == 10.0
    assert s.expire(9.99) == []
    assert s.expire(10.0) == [late]
    assert late.status is RequestStatus.FINISHED_EXPIRED_WAITING
    assert late.status.finish_reason == "timeout"
    assert s.get_request("late") is None and s.num_waiting == 0
    assert s.next_deadline() is None


def test_a_running_request_past_its_deadline_times_out_and_frees_its_blocks() -> None:
    s = make_scheduler()
    r = make_request("r", 6, max_tokens=50)
    r.deadline = 5.0
    s.add_request(r)
    step(s)
    step(s)
    assert r.num_output_tokens == 2
    assert s.expire(5.0) == [r]
    assert r.status is RequestStatus.FINISHED_TIMEOUT
    assert s.num_running == 0 and not s.has_unfinished_requests()
    assert s.block_manager.block_table("r") == []
    s.block_manager.check_invariants()


def test_a_request_in_prefill_without_a_token_expires_waiting() -> None:
    s = make_scheduler(budget=4)
    r = make_request("long", 12, max_tokens=4)  # three chunked-prefill steps
    r.deadline = 1.0
    s.add_request(r)
    step(s)
    running = r.status  # (a local, so mypy does not keep `r.status` narrowed past expire())
    assert running is RequestStatus.RUNNING and r.num_output_tokens == 0
    assert s.expire(1.0) == [r]
    assert r.status is RequestStatus.FINISHED_EXPIRED_WAITING


def test_finished_and_aborted_requests_never_expire() -> None:
    s = make_scheduler()
    done = make_request("done", 4, max_tokens=1)
    gone = make_request("gone", 4, max_tokens=8)
    done.deadline = gone.deadline = 1.0
    s.add_request(done)
    s.add_request(gone)
    step(s)  # "done" finishes at its length limit
    s.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert s.expire(100.0) == []
    assert done.status is RequestStatus.FINISHED_LENGTH
    assert gone.status is RequestStatus.FINISHED_ABORTED


def test_expiry_is_earliest_deadline_first_and_ignores_requests_without_one() -> None:
    s = make_scheduler(max_seqs=1, policy="priority")
    a, b, c = (make_request(rid, 4) for rid in "abc")
    a.deadline, b.deadline = 3.0, 2.0
    for r in (a, b, c):
        s.add_request(r)
    assert s.expire(5.0) == [b, a]
    assert s.get_request("c") is c and s.num_waiting == 1
