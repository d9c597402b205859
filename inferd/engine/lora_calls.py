"""The front's side of the LoRA calls to the engine core: the adapters it knows, the calls waiting.

    calls = LoRACalls(ready.loras)          # the --lora-modules, registered at start-up
    calls.get("sql")                        # LoRARequest | None, no round trip (the gateway's
                                            # name resolution, once per request)
    message, reply = calls.add(LoRARequest("chat", calls.next_id(), "/adapters/chat"))
    core.send(message); await reply         # raises InvalidRequestError when refused
    calls.on_reply(event)                   # each LoRAReply, as the core's messages arrive

The cache changes with the calls, not with the replies' contents: a removal takes effect when it
is sent (new requests naming it are refused at once, while the core lets its running ones
finish), an addition once its load succeeded. The core answers an add when its load ends, so
replies come in any order; each carries its call's id.
"""

from __future__ import annotations

import asyncio
import itertools

from inferd.engine.messages import AddLoRA, ListLoRAs, LoRAReply, RemoveLoRA
from inferd.errors import InferdError, InvalidRequestError
from inferd.lora.request import LoRARequest


class LoRACalls:
    def __init__(self, loras: list[LoRARequest] | None = None) -> None:
        self._known: dict[str, LoRARequest] = {}
        self._waiting: dict[int, tuple[asyncio.Future[LoRAReply], LoRARequest | None]] = {}
        self._call_ids = itertools.count(1)
        self._last_id = 0
        self.reset(loras or [])

    def reset(self, loras: list[LoRARequest]) -> None:
        """Replaces what is known with the core's own list."""
        self._known = {lora.lora_name: lora for lora in loras}
        self._last_id = max([self._last_id, *(lora.lora_int_id for lora in loras)])

    def get(self, name: str) -> LoRARequest | None:
        return self._known.get(name)

    def all(self) -> list[LoRARequest]:
        """The registered adapters, in the order they were registered."""
        return list(self._known.values())

    def next_id(self) -> int:
        """A `lora_int_id` no adapter of this server has had (vLLM numbers them from 1)."""
        self._last_id += 1
        return self._last_id

    def add(self, lora: LoRARequest) -> tuple[AddLoRA, asyncio.Future[LoRAReply]]:
        call_id, reply = self._wait(lora)
        return AddLoRA(call_id, lora), reply

    def remove(self, name: str) -> tuple[RemoveLoRA, asyncio.Future[LoRAReply]]:
        self._known.pop(name, None)
        call_id, reply = self._wait(None)
        return RemoveLoRA(call_id, name), reply

    def list(self) -> tuple[ListLoRAs, asyncio.Future[LoRAReply]]:
        call_id, reply = self._wait(None)
        return ListLoRAs(call_id), reply

    def _wait(self, adding: LoRARequest | None) -> tuple[int, asyncio.Future[LoRAReply]]:
        call_id = next(self._call_ids)
        reply: asyncio.Future[LoRAReply] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = (reply, adding)
        return call_id, reply

    def forget(self, reply: asyncio.Future[LoRAReply]) -> None:
        """Drops a call whose message could not be sent (no reply will come)."""
        for call_id, (waiting, _) in list(self._waiting.items()):
            if waiting is reply:
                del self._waiting[call_id]

    def on_reply(self, reply: LoRAReply) -> None:
        waiting = self._waiting.pop(reply.call_id, None)
        if waiting is None:
            return
        future, adding = waiting
        if adding is not None and reply.error_type is None:
            self._known[adding.lora_name] = adding
        if not future.done():  # a caller cancelled meanwhile has gone
            future.set_result(reply)

    def fail_all(self, error: Exception) -> None:
        """The core is gone: every call waiting raises `error`."""
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(error)


def raise_for(reply: LoRAReply) -> None:
    """A refused call as the error taxonomy's exception (a "not_found" is the caller's to read)."""
    if reply.error_type == "invalid_request":
        raise InvalidRequestError(reply.message, "lora_path")
    if reply.error_type == "internal":
        raise InferdError(reply.message)
