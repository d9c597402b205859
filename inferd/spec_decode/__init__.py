"""Speculative decoding: draft proposers, the adaptive choice of k, and acceptance counters."""
