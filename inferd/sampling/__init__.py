"""Sampling: per-request parameters (vLLM's names), penalties, and the batched sampler."""
