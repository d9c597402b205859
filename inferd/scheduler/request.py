"""A request as the scheduler sees it: one sequence of token ids and how much of it is in the cache.

`n > 1` choices are fanned out by the engine into one Request each, so the scheduler only ever
deals with single sequences. Pure Python: no torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inferd.sampling.params import SamplingParams
from inferd.sampling.structured import TokenConstraint
from inferd.types import RequestStatus

__all__ = ["Request", "RequestStatus"]


@dataclass(eq=False)
class Request:
    """One sequence. Invariant: 0 <= num_computed_tokens <= num_tokens.

    `num_computed_tokens` counts tokens whose K/V are in the cache. A request needs
    `num_tokens - num_computed_tokens` more tokens computed before it can sample again; in steady
    decode that is exactly 1 (the token sampled last step).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Longest output allowed: min(sampling_params.max_tokens, max_model_len - prompt length).
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Lower value is served first (vLLM's convention); FIFO by arrival within one value.
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The token id or stop string that ended the request, if one did.
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens the prefix cache held at the request's first admission; None until then. A
    # re-admission after a preemption leaves it as it was (that hit is mostly its own recompute).
    num_cached_tokens: int | None = None
    # time.monotonic() instant past which the scheduler finishes the request (see
    # Scheduler.expire); None: no deadline.
    deadline: float | None = None
    # The grammar its output must follow (structured outputs), set once compiled; it survives
    # preemption with the outputs it accepted.
    grammar: TokenConstraint | None = None
    # The LoRA adapter it runs under (its name); None: the base model.
    lora_name: str | None = None
    # Speculative decoding: tokens proposed to follow all_token_ids, verified by the next step
    # that schedules the request (the scheduler takes them, then clears this); not outputs.
    draft_token_ids: list[int] = field(default_factory=list)
    # Its drafts' acceptance rate so far (a running average, spec_decode/policy.py); None: none.
    draft_acceptance: float | None = None
    # prompt + output, kept as one list so the hot path never concatenates.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def discard_outputs_after(self, num_output_tokens: int) -> None:
        """Drops the output tokens past the first `num_output_tokens`: a stop string matched
        within tokens one speculative step appended together. Only for a request that ends."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]
