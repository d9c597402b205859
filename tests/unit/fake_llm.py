"""A fake LLM engine client for the gateway's in-process tests: it answers every prompt with
REPLY (cut to max_tokens, one choice per n), records what it was asked, and keeps LoRA adapters
by name; its KV digest is a real block manager's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from inferd.engine.generate_request import GenerateRequest
from inferd.engine.info import EngineStats
from inferd.engine.messages import KVBlocks
from inferd.errors import InvalidRequestError
from inferd.kv_cache.block_manager import BlockManager
from inferd.lora.request import LoRARequest
from inferd.types import CompletionOutput, Logprob, RequestMetrics, RequestOutput

REPLY = "hello world"
PROMPT_IDS = list(range(10))


class ByteTokenizer:
    """One token per byte (ids 0..255); enough for the gateway, which only encodes/decodes."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@dataclass
class Info:
    max_model_len: int = 64
    vocab_size: int = 256
    model_path: str = "/fake"
    reasoning_parser: str | None = None


@dataclass
class FakeLLM:
    model_name: str = "fake-model"
    tokenizer: Any = field(default_factory=ByteTokenizer)
    info: Info = field(default_factory=Info)
    ready: bool = True
    dead: bool = False
    fail_with: Exception | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    adapters: dict[str, LoRARequest] = field(default_factory=dict)

    def stats(self) -> EngineStats:
        return EngineStats()

    async def kv_blocks(self, limit: int, recent_s: float = 0.0) -> KVBlocks:
        """A real block manager's digest after one request cached two blocks of PROMPT_IDS."""
        blocks = BlockManager(num_blocks=8, block_size=4, block_hashes=True)
        blocks.allocate("r", len(PROMPT_IDS))
        blocks.cache_full_blocks("r", PROMPT_IDS, len(PROMPT_IDS))
        digest = blocks.held_hashes(limit, recent_s)
        return KVBlocks(4, 8, digest.hashes, blocks.num_cached_blocks, True, digest.num_recent)

    def lora(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def loras(self) -> list[LoRARequest]:
        return list(self.adapters.values())

    def next_lora_id(self) -> int:
        return len(self.adapters) + 1

    async def add_lora(self, lora_request: LoRARequest) -> None:
        if "missing" in lora_request.lora_path:
            raise InvalidRequestError(f"{lora_request.lora_path}: no adapter_config.json")
        self.adapters[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> bool:
        return self.adapters.pop(lora_name, None) is not None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        params = request.params
        self.seen.append(
            {
                "priority": request.priority,
                "timeout_s": request.timeout_s,
                "params": params,
                "lora_request": request.lora_request,
            }
        )
        if self.fail_with is not None:
            raise self.fail_with
        limit = min(params.max_tokens or len(REPLY), len(REPLY))
        for k in range(limit):
            last = k == limit - 1
            reason = ("stop" if limit == len(REPLY) else "length") if last else None
            outs = [_choice(i, REPLY[k], reason, params.logprobs) for i in range(params.n)]
            metrics = RequestMetrics(0.0, first_scheduled_time=1.0, first_token_time=1.5)
            if last:
                metrics.finished_time = 2.0
            ids = request.prompt_token_ids
            yield RequestOutput(request.request_id, request.prompt, ids, outs, last, metrics)


def _choice(i: int, ch: str, reason: str | None, logprobs: int | None) -> CompletionOutput:
    tid = ord(ch)
    lps = None
    if logprobs is not None:
        alts = {tid: Logprob(-0.5, 1, ch), 120: Logprob(-1.0, 2, "x"), 121: Logprob(-2.0, 3, "y")}
        lps = [alts]
    return CompletionOutput(i, ch, [tid], reason, None, lps)
