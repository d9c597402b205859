"""What a request's output must match: a JSON schema, a regex, one of some strings, or a grammar.

vLLM's `structured_outputs` shape (`SamplingParams(structured_outputs=StructuredOutputsParams(
json=...))`), pure Python so the gateway can build it without loading the grammar backend.
Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` and `structural_tag` is set.

    >>> StructuredOutputsParams(choice=["yes", "no"]).spec()
    ('choice', '["yes", "no"]')

`spec()` is the canonical (kind, text) pair that the engine compiles and caches grammars by: two
requests with the same schema share one compiled grammar. The engine side (compilation, token
masks) is inferd/sampling/grammar.py.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """The constraint on one request's output.

    `json`: a JSON schema (an object or its JSON text). `grammar`: EBNF (GBNF, as llama.cpp and
    xgrammar read it). `structural_tag`: xgrammar's structural tag JSON (tool calls inside free
    text). `disable_any_whitespace`: JSON without optional whitespace (vLLM's field), which
    keeps small models from filling the output with blanks.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object and structural_tag (got {', '.join(given) or 'none'})",
                "structured_outputs",
            )
        if isinstance(self.json, str):
            self.json = _parse_json(self.json, "json schema")
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError("a JSON schema is an object", "structured_outputs.json")
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError(
                "choice is a non-empty list of strings", "structured_outputs.choice"
            )
        if self.structural_tag is not None:
            _parse_json(self.structural_tag, "structural tag")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str]:
        """(kind, text): the cache key of the compiled grammar. Key order of a schema is kept:
        it is the order the properties are generated in."""
        kind = self.kind
        if kind == "json":
            text = _json.dumps(self.json, ensure_ascii=False)
        elif kind == "choice":
            text = _json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = str(getattr(self, kind))
        if self.disable_any_whitespace and kind in ("json", "json_object"):
            kind += ":compact"
        return kind, text


def _parse_json(text: str, what: str) -> Any:
    try:
        return _json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"the {what} is not valid JSON: {e}", "structured_outputs") from e


class TokenConstraint(Protocol):
    """A request's grammar state as the scheduler carries it (inferd/sampling/grammar.py).

    It lives on the Request, so a preempted request keeps it across recompute: its outputs are
    kept, and so is the state that accepted them."""

    @property
    def active(self) -> bool:
        """False while the constraint does not apply yet (the model is still reasoning)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: the answer is complete."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advances over a sampled token; False if the grammar refuses it."""
        ...

    def rollback_drafts(self, num_kept: int) -> int:
        """Keeps the first `num_kept` drafts the last mask step advanced it through, undoes the
        rest (speculative decoding); returns how many it holds (0 when it took no drafts)."""
        ...
