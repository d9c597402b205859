"""Per-request sampling parameters, with vLLM's field names so vLLM scripts port unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from inferd.errors import InvalidRequestError
from inferd.sampling.structured import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How one prompt is continued.

    >>> SamplingParams(temperature=0.0, max_tokens=8, stop=["\\n"]).greedy
    True
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per sampled token (the sampled one included)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match this schema, regex, choice or grammar (sampling/structured.py).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by __post_init__: the normalized stop strings.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of `n` choices: one sequence each, seeds kept distinct."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1", "n")
        _check_float(self.temperature, "temperature", lo=0.0)
        _check_float(self.top_p, "top_p", lo=0.0, hi=1.0)
        _check(self.top_p > 0.0, "top_p must be in (0, 1]", "top_p")
        _check_float(self.min_p, "min_p", lo=0.0, hi=1.0)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k must be -1, 0 or positive", "top_k")
        _check_float(self.repetition_penalty, "repetition_penalty", lo=0.0)
        _check(
            self.repetition_penalty > 0.0, "repetition_penalty must be > 0", "repetition_penalty"
        )
        _check_float(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        _check(self.seed is None or _is_int(self.seed), "seed must be an integer", "seed")
        self._validate_lengths()
        self._validate_stops()

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens must be an integer >= 1",
                "max_tokens",
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens must be >= 0",
            "min_tokens",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens", "min_tokens"
            )
        if self.logprobs is not None:
            _check(
                _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
                "logprobs must be an integer in [0, 20]",
                "logprobs",
            )

    def _validate_stops(self) -> None:
        _check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop must be a non-empty string or a list of non-empty strings",
            "stop",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids or ()),
            "stop_token_ids must be non-negative integers",
            "stop_token_ids",
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def _check_float(v: object, name: str, lo: float | None = None, hi: float | None = None) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and lo is not None:
        ok = v >= lo  # type: ignore[operator]
    if ok and hi is not None:
        ok = v <= hi  # type: ignore[operator]
    bounds = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
    _check(ok, f"{name} must be a finite number{bounds}", name)
