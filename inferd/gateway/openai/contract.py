"""The OpenAI-compatible responses as /openapi.json declares them (requests: protocol.py; see
gateway/contract.py for the rules the document keeps).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from inferd.gateway.contract import OpenModel


class PromptTokensDetails(OpenModel):
    cached_tokens: int = Field(description="Prompt tokens the prefix cache already held")


class Usage(OpenModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Choice(OpenModel):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionChoice(_Choice):
    text: str


class AssistantMessage(OpenModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class _Completion(OpenModel):
    id: str
    created: int
    model: str
    usage: Usage
    timings: dict[str, float] | None = Field(default=None, description="Stage seconds")


class CompletionResponse(_Completion):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Completion):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(OpenModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = Field(default=None, description="The model's (or adapter's) folder")
    parent: str | None = Field(
        default=None, description="A LoRA adapter's base model (the served model's name)"
    )


class ModelCards(OpenModel):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(OpenModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of float32 LE")


class EmbeddingUsage(OpenModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
