"""Admission: what gets in, and when it goes on (pure Python, no torch).

front_door.py   the LLM front door: bounded queue, queue deadlines, release policy, Retry-After
queue.py        the bounded priority queue with deadlines it is built on
timeouts.py     the shorten-only rule for a request's timeout (both lanes)
retry_after.py  the Retry-After hint from the recent completion rate (both lanes)
prompt_check.py the prompt and context-window checks (gateway, engine, scheduler)
rate_limit.py   per-key rate and concurrency limits
lazy_heap.py    the min-heap with lazy deletion under the queue and the scheduler
"""

from inferd.admission.queue import AdmissionQueue, QueueEntry

__all__ = ["AdmissionQueue", "QueueEntry"]
