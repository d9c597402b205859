"""The draft model's forward (speculative `draft_model`): greedy next tokens of a batch of chunks.

spec_decode/draft_model.py decides what the draft computes (its chunks, on its own block tables);
this runs them through the draft's `ModelRunner` (its inputs, attention metadata and kernels are
the target's code, on the draft's own KV pool) and takes each chunk's argmax at its last row: the
greedy screen's where the draft's lm_head has one (the same tokens, kernels/greedy.py), else the
full logits'. Steps of one row per sequence take the one-call native decode step as any decode.
"""

from __future__ import annotations

import torch

from inferd.executor.model_runner import ModelRunner
from inferd.scheduler.output import ScheduledChunk, SchedulerOutput


class DraftRunner:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def __call__(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """spec_decode/draft_model.py's DraftForward: each chunk's greedy next token."""
        runner = self.runner
        num_tokens = sum(c.num_tokens for c in chunks)
        inp = runner.prepare_inputs(SchedulerOutput(chunks, num_tokens))
        hidden = runner.model(inp.input_ids, inp.positions, inp.meta, inp.logits_indices)
        tokens = None if runner.greedy_head is None else runner.greedy_head(hidden)
        if tokens is None:
            tokens = runner.model.compute_logits(hidden, False).argmax(dim=-1)
        ids: list[int] = tokens.tolist()
        return {c.request.request_id: t for c, t in zip(inp.sampling_chunks, ids, strict=True)}
