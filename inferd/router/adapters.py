"""LoRA adapters as the router sees them: which `model` names are adapters, and where each one
ran last.

A replica's prefix cache keys its blocks on the adapter (kv_cache/block_hash.py: a prompt under
adapter `sql` chains from its own seed), so the router must hash a prompt under the same name to
match the replica's KV events and block digest. The OpenAI `model` field names the adapter, and
GET /v1/models lists adapters as vLLM does, each with the base it runs on:

    {"data": [{"id": "base-7b", ...}, {"id": "sql", "parent": "base-7b", "root": "/adapters/sql"}]}

`AdapterCatalog.lora_name(model)`: a name some replica lists with a `parent` is an adapter; one
listed without (the base model, an embedding model) is not; a name no replica lists, once some
replica's list was read, is an adapter loaded since the last health check (POST
/v1/load_lora_adapter) or an unknown model the replica will answer 404 for, and hashing it under
its own name is right either way. Before any list is read every name is the base model's.

`AdapterPlacement` remembers the replica each adapter's last request went to (bounded LRU), for
the policy's adapter affinity (router/policy.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class ServedModels:
    """One replica's GET /v1/models: names served as LoRA adapters and the other ones."""

    adapters: frozenset[str]
    others: frozenset[str]


def served_models(body: bytes) -> ServedModels | None:
    """The model list of a /v1/models body (OpenAI's `{"data": [{"id": ...}]}`), or None when the
    body is not one."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
    adapters = frozenset(c["id"] for c in cards if c.get("parent") is not None)
    return ServedModels(adapters, frozenset(c["id"] for c in cards) - adapters)


class AdapterCatalog:
    """The model lists the replicas last reported, per replica."""

    def __init__(self) -> None:
        self._served: dict[str, ServedModels] = {}

    def update(self, replica: str, served: ServedModels) -> None:
        self._served[replica] = served

    def forget(self, replica: str) -> None:
        self._served.pop(replica, None)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request for `model` runs under; None: the base model (module
        docstring)."""
        if model is None or not self._served:
            return None
        if any(model in s.adapters for s in self._served.values()):
            return model
        if any(model in s.others for s in self._served.values()):
            return None
        return model


class AdapterPlacement:
    """The replica each adapter's last request was sent to, for the `capacity` adapters sent
    most recently."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def ran(self, adapter: str, replica: str) -> None:
        self._last[adapter] = replica
        self._last.move_to_end(adapter)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def last(self, adapter: str | None) -> str | None:
        """Where `adapter` ran last, if it is remembered (None for the base model)."""
        return None if adapter is None else self._last.get(adapter)
