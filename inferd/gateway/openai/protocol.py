"""OpenAI request bodies (pydantic), with vLLM's extensions, and their mapping to SamplingParams.

Schema checks (types, NaN, ranges a JSON schema can say) happen here, at parse time; checks that
need the model (context window, vocabulary) happen in the route before anything is queued.
Unknown fields are ignored, as OpenAI's and vLLM's servers do. Numbers are JSON numbers
(`"0.5"` and `true` are refused, not converted) and an integer is any number without a fraction
(`2.0` is 2, as JSON Schema counts it), so the schema in /openapi.json is the validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_validator,
)

from inferd.sampling.params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
# A `timeout` shorter than this is refused (400): no server admits and schedules a request that
# fast under load, so a smaller value could only ever end in 503 queue_timeout (a retryable
# status for a request that can never succeed).
MIN_TIMEOUT_S = 0.1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


def _integral(value: Any) -> Any:
    """2.0 -> 2: JSON Schema's `integer` includes it (1.5, "2" and true stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[StrictInt, BeforeValidator(_integral)]
TokenIds = list[Annotated[JsonInt, Field(ge=0)]]


class _SamplingFields(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extensions, then inferd's `timeout`."""

    model: str | None = None
    max_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    n: JsonInt = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: JsonInt | None = None
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions.
    top_k: JsonInt | None = Field(default=None, ge=-1)
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0)
    min_tokens: JsonInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Lower is served first (vLLM's convention); FIFO within one value.
    priority: JsonInt = 0
    # Seconds from arrival; may only shorten the server's --request-timeout.
    timeout: StrictFloat | None = Field(
        default=None,
        ge=MIN_TIMEOUT_S,
        description="Seconds from arrival; may only shorten the server's --request-timeout. "
        "Still queued when it passes: 503 `queue_timeout`; generating: finish_reason `timeout`.",
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError (HTTP 400) on combinations the engine refuses."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


PromptInput = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: PromptInput
    # OpenAI's default for completions is 16 tokens.
    max_tokens: JsonInt | None = Field(default=16, ge=1)
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        content: Any = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        msg: dict[str, Any] = {"role": role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM extensions for the chat template.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
