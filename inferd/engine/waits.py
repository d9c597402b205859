"""Requests held before the scheduler until what they need is ready: their grammar compiled
(structured outputs) and their LoRA adapter in host memory.

Both happen off the step loop (xgrammar's thread pool, the adapter loader's thread), so the
running requests keep stepping meanwhile. Each step the engine asks which waits are over:

- ready: every future done and the adapter loaded -> the request joins the scheduler, charged
  the wait as `grammar_compile_s` / `lora_load_s` (a cached grammar or a loaded adapter: 0);
- failed: the grammar did not compile, the adapter did not load (the reason, a 400), or the
  grammar is past `--grammar-compile-timeout` -> the request is refused.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferd.engine.output_processor import OutputKind
from inferd.errors import InvalidRequestError
from inferd.scheduler.request import Request

if TYPE_CHECKING:
    from inferd.lora.adapter import LoRAAdapter
    from inferd.sampling.grammar import CompiledGrammar


@dataclass
class Wait:
    request_id: str
    prompt: str | None
    children: list[Request]
    output_kind: OutputKind
    submitted: float
    grammar: concurrent.futures.Future[CompiledGrammar] | None = None
    # Past it the grammar's compile is given up (math.inf without a grammar).
    deadline: float = math.inf
    # The adapter being loaded for it (None: none, or already in host memory).
    adapter: concurrent.futures.Future[LoRAAdapter] | None = None

    @property
    def pending(self) -> list[concurrent.futures.Future[Any]]:
        return [f for f in (self.grammar, self.adapter) if f is not None and not f.done()]

    @property
    def lora_name(self) -> str | None:
        return self.children[0].lora_name


@dataclass(frozen=True)
class Ready:
    wait: Wait
    grammar: CompiledGrammar | None
    grammar_compile_s: float
    lora_load_s: float


class Waits:
    """The held requests, in arrival order."""

    def __init__(self, grammar_timeout_s: float, is_loaded: Callable[[str], bool]) -> None:
        """`is_loaded(name)`: the adapter is in host memory (moved there by the engine loop)."""
        self.grammar_timeout_s = grammar_timeout_s
        self.is_loaded = is_loaded
        self._waits: list[Wait] = []

    def __bool__(self) -> bool:
        return bool(self._waits)

    def __contains__(self, request_id: str) -> bool:
        return any(w.request_id == request_id for w in self._waits)

    def add(self, wait: Wait) -> None:
        self._waits.append(wait)

    def remove(self, request_ids: list[str]) -> None:
        self._waits = [w for w in self._waits if w.request_id not in request_ids]

    def lora_names(self) -> set[str]:
        return {n for w in self._waits if (n := w.lora_name) is not None}

    def take(self, now: float) -> tuple[list[Ready], list[tuple[str, InvalidRequestError]]]:
        """The waits over at `now`: (ready, refused with the reason)."""
        ready: list[Ready] = []
        refused: list[tuple[str, InvalidRequestError]] = []
        still: list[Wait] = []
        for wait in self._waits:
            try:
                over = self._over(wait, now)
            except InvalidRequestError as e:
                refused.append((wait.request_id, e))
                continue
            if over is None:
                still.append(wait)
            else:
                ready.append(over)
        self._waits = still
        return ready, refused

    def _over(self, wait: Wait, now: float) -> Ready | None:
        """Ready, None (still waiting), or raises the reason it is refused."""
        if wait.adapter is not None and wait.adapter.done():
            wait.adapter.result()  # raises the load's reason
        grammar_done = wait.grammar is None or wait.grammar.done()
        loaded = wait.lora_name is None or self.is_loaded(wait.lora_name)
        if grammar_done and loaded:
            grammar = None if wait.grammar is None else wait.grammar.result()
            compile_s = 0.0 if wait.grammar is None else now - wait.submitted
            load_s = 0.0 if wait.adapter is None else now - wait.submitted
            return Ready(wait, grammar, compile_s, load_s)
        if not grammar_done and now >= wait.deadline:
            raise InvalidRequestError(
                f"the grammar did not compile within {self.grammar_timeout_s:g} s (a schema this "
                "complex is refused; simplify it, or raise --grammar-compile-timeout)",
                "structured_outputs",
            )
        return None

    def wait_any(self, timeout_s: float) -> None:
        """Blocks until one pending future is done or `timeout_s` passes (the compile and the
        load release the GIL), rather than spin."""
        futures = [f for w in self._waits for f in w.pending]
        if futures:
            concurrent.futures.wait(futures, timeout_s, "FIRST_COMPLETED")
