"""The router's view of a request body: validated with the gateway's own request models (so a
malformed request gets the same 4xx a replica would give, without being forwarded) and turned
into the prompt token ids the prefix match uses.

Chat requests are rendered with the model's chat template over *all* messages, exactly as a
replica renders them, so a multi-turn conversation matches on its whole history, not only on its
system prompt (sglang#26263). A completion with several prompts routes on its first one; an
embedding request on its first input; KServe v2 bodies are not tokenized (they route on load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from inferd.gateway.errors import bad_request
from inferd.gateway.openai.embeddings import EmbeddingRequest
from inferd.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferd.gateway.openai.serving import tokenize_body
from inferd.preprocess.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
_MODELS: dict[str, type[BaseModel]] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    EMBEDDINGS: EmbeddingRequest,
}
TOKENIZED_PATHS = tuple(_MODELS)


def load_tokenizer(model: str, tokenizer: str | None, revision: str | None) -> Tokenizer:
    """The tokenizer `inferd serve --model MODEL` would load (a folder, inferd-tiny, a hub id)."""
    from inferd.config import read_environment
    from inferd.models.loader import resolve_model_path

    path = resolve_model_path(tokenizer or model, revision, read_environment())
    return Tokenizer.from_pretrained(Path(path))


def validate(path: str, body: Any) -> BaseModel:
    """The body as the gateway's model for `path`; raises what the gateway's handlers map to a
    400 in OpenAI's error format."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return _MODELS[path].model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors) from e


def prompt_token_ids(tok: Tokenizer, request: BaseModel) -> list[int]:
    """What the replica will prefill for this request (its first prompt): the gateway's own
    tokenization, so the router's blocks are the replica's."""
    if isinstance(request, ChatCompletionRequest | CompletionRequest):
        prompts = tokenize_body(tok, request)
        return prompts[0].ids if prompts else []
    if isinstance(request, EmbeddingRequest):
        first = request.input[0] if isinstance(request.input, list) else request.input
        return tok.encode(first) if isinstance(first, str) else []
    return []


def requested_model(request: BaseModel) -> str | None:
    """The request's `model` field: the served model or LoRA adapter it names (None: unnamed)."""
    model = getattr(request, "model", None)
    return model if isinstance(model, str) else None
