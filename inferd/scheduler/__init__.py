"""Continuous batching: which requests run in the next step and how many tokens each computes,
under a token budget, with chunked prefill, preemption and deadlines (pure Python)."""
