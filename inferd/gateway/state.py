"""What the gateway needs from the engine client, and the app's shared state.

`EngineClient` is the slice of inferd.engine.async_client.AsyncLLM the routes use; tests pass a
fake with the same shape. Until the engine has loaded, `GatewayState.llm` is None and every
generation route answers 503 "not_ready".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from inferd.config import ServerConfig
from inferd.diffusion.request import ImageEngine, ImageEngineStats
from inferd.engine.generate_request import GenerateRequest
from inferd.engine.info import EngineStats
from inferd.engine.messages import KVBlocks
from inferd.errors import DrainingError
from inferd.gateway.errors import unavailable
from inferd.lora.request import LoRARequest
from inferd.preprocess.tokenizer import Tokenizer
from inferd.telemetry.image_metrics import ImageMetrics
from inferd.telemetry.metrics import EngineGauges, ServerMetrics
from inferd.telemetry.model_metrics import ModelMetrics
from inferd.telemetry.tracing import RequestTracer
from inferd.types import RequestOutput

if TYPE_CHECKING:
    from inferd.gateway.auth import Guard
    from inferd.repository.manager import ModelRepository


class ModelInfo(Protocol):
    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def reasoning_parser(self) -> str | None: ...


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer

    @property
    def info(self) -> ModelInfo: ...

    @property
    def ready(self) -> bool: ...

    @property
    def dead(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    async def kv_blocks(self, limit: int, recent_s: float = 0.0) -> KVBlocks: ...

    # LoRA adapters (gateway/openai/adapters.py): `lora` and `loras` read the client's cache.
    def lora(self, name: str) -> LoRARequest | None: ...

    def loras(self) -> list[LoRARequest]: ...

    def next_lora_id(self) -> int: ...

    async def add_lora(self, lora_request: LoRARequest) -> None: ...

    async def remove_lora(self, lora_name: str) -> bool: ...


@dataclass
class GatewayState:
    server: ServerConfig
    metrics: ServerMetrics
    # Per-model metrics of the repository's models, in the same registry as `metrics`.
    model_metrics: ModelMetrics
    # The image lane's metrics, in the same registry (create_app makes them).
    image_metrics: ImageMetrics | None = None
    tracer: RequestTracer | None = None
    llm: EngineClient | None = None
    # Classic models (--model-repository); None when the server runs without one.
    repository: ModelRepository | None = None
    # Image models by served name (`set_image_engines`); empty when the server runs none.
    images: dict[str, ImageEngine] = field(default_factory=dict)
    # API keys, scopes and per-key limits (gRPC applies them too); None: no authentication.
    guard: Guard | None = None
    # What the server was started with: readiness waits for each to load.
    serves_llm: bool = True
    serves_repository: bool = False
    draining: bool = False
    # HTTP generation requests and WebSocket streams being served right now (drain waits on it).
    inflight: int = 0
    started: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        if self.server.served_model_name:
            return self.server.served_model_name
        return self.llm.model_name if self.llm is not None else ""

    @property
    def ready(self) -> bool:
        """Every part the server was started with is up: the LLM, the image models and the model
        repository."""
        if self.draining:
            return False
        llm = self.llm
        if self.serves_llm and (llm is None or not llm.ready or llm.dead):
            return False
        if not all(engine.ready() for engine in self.images.values()):
            return False
        if not self.serves_repository:
            return True
        return self.repository is not None and self.repository.ready()

    def admitting(self) -> None:
        """Raises DrainingError (503 "draining", gRPC UNAVAILABLE) once the server drains:
        every route that starts new work calls it first."""
        if self.draining:
            raise DrainingError("the server is shutting down")

    def engine(self) -> EngineClient:
        """The engine, or the 503 that says why there is none to use."""
        llm = self.llm
        if self.draining:
            raise unavailable("the server is shutting down", "draining")
        if llm is None:
            raise unavailable("the model is still loading", "not_ready")
        if llm.dead:
            raise unavailable("the engine process died", "engine_dead")
        return llm

    def image_stats(self) -> dict[str, ImageEngineStats]:
        return {name: engine.stats() for name, engine in self.images.items()}

    def model_inflight(self) -> dict[str, int]:
        return {} if self.repository is None else self.repository.inflight()

    def engine_gauges(self) -> EngineGauges | None:
        llm = self.llm
        if llm is None:
            return None
        return gauges_from_stats(llm.stats())


def gateway_state(app: Starlette) -> GatewayState:
    """The state `create_app` attached to `app`."""
    state: GatewayState = app.state.gateway
    return state


def gateway(conn: HTTPConnection) -> GatewayState:
    """The state of the app serving `conn`: a route's Request or WebSocket alike."""
    return gateway_state(conn.app)


def gauges_from_stats(s: EngineStats) -> EngineGauges:
    """The engine client's stats as the metrics' gauges."""
    return EngineGauges(
        running=s.running,
        waiting=s.waiting,
        queued=s.queued,
        queued_prompt_tokens=s.queued_prompt_tokens,
        kv_cache_usage=s.kv_cache_usage,
        step_tokens=s.step_num_batched_tokens,
        step_seqs=s.step_num_seqs,
        step_budget=s.step_token_budget,
        preemptions_total=s.num_preemptions_total,
        prefix_cache_queries_tokens_total=s.prefix_cache_queries_tokens_total,
        prefix_cache_hits_tokens_total=s.prefix_cache_hits_tokens_total,
        grammar_cache_hits_total=s.grammar_cache_hits_total,
        grammar_cache_misses_total=s.grammar_cache_misses_total,
        spec_decode_num_drafts_total=s.spec_decode_num_drafts_total,
        spec_decode_num_draft_tokens_total=s.spec_decode_num_draft_tokens_total,
        spec_decode_num_accepted_tokens_total=s.spec_decode_num_accepted_tokens_total,
        spec_decode_accepted_per_pos=s.spec_decode_accepted_per_pos,
        cache_config=s.cache_config,
    )
