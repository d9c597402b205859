"""What a caller hands an engine client for one generation: the GenerateRequest value object.

    async for delta in llm.generate(GenerateRequest("r1", ids, SamplingParams(max_tokens=8))):
        ...

One typed value instead of the same eight parameters in the client, the gateway's protocol of
it and every fake of it. No torch here: the gateway builds these.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.lora.request import LoRARequest
from inferd.sampling.params import SamplingParams
from inferd.telemetry.timeline import RequestTimeline


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The text the ids came from, returned in outputs (the engine core never sees it).
    prompt: str | None = None
    # Lower value is served first (vLLM's convention).
    priority: int = 0
    # Seconds from arrival; may only shorten the server's default (inferd.admission.timeouts).
    timeout_s: float | None = None
    # Engine milestones are merged into it as outputs arrive.
    timeline: RequestTimeline | None = None
    # The LoRA adapter it runs under (the gateway resolves the `model` field); None: the base.
    lora_request: LoRARequest | None = None
