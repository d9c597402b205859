"""The prompt checks, in one place: a non-empty prompt of in-vocabulary ids whose output fits
the model's context window.

The gateway applies them before queueing (HTTP 400; "context_length_exceeded" for the window),
the engine when a request is added (the offline API), the scheduler keeps the window rule as
its last line of defence.

>>> check_prompt([5, 6, 7], None, max_model_len=64, vocab_size=100)
61
"""

from __future__ import annotations

from collections.abc import Sequence

from inferd.errors import ContextWindowError, InvalidRequestError


def check_prompt(
    ids: Sequence[int], max_tokens: int | None, *, max_model_len: int, vocab_size: int
) -> int:
    """The output tokens the request may produce (see `check_context_window`).

    Raises InvalidRequestError (param "prompt") for an empty prompt or an id outside
    [0, vocab_size), then ContextWindowError as `check_context_window` does."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", "prompt"
        )
    return check_context_window(len(ids), max_tokens, max_model_len)


def check_context_window(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output tokens the request may produce: `max_tokens`, or all the room left when None.

    Raises ContextWindowError (param "prompt") when the prompt leaves no room for one output
    token, and (param "max_tokens") when prompt + max_tokens passes the window."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextWindowError(
            f"the prompt has {num_prompt_tokens} tokens; this model's context window is "
            f"{max_model_len} tokens",
            "prompt",
        )
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ContextWindowError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"context window of {max_model_len} tokens",
            "max_tokens",
        )
    return max_tokens
