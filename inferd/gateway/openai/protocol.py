"""OpenAI request bodies (pydantic), with vLLM's extensions, and their mapping to SamplingParams.

Schema checks (types, NaN, ranges a JSON schema can say) happen here, at parse time; checks that
need the model (context window, vocabulary) happen in the route before anything is queued.
Unknown fields are ignored, as OpenAI's and vLLM's servers do. Numbers are JSON numbers
(`"0.5"` and `true` are refused, not converted) and an integer is any number without a fraction
(`2.0` is 2, as JSON Schema counts it), so the schema in /openapi.json is the validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
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

from inferd.errors import InvalidRequestError
from inferd.sampling.params import SamplingParams
from inferd.sampling.structured import StructuredOutputsParams

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


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` field: exactly one of json, regex, choice, grammar,
    json_object, structural_tag."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: StrictBool = False

    def params(self) -> StructuredOutputsParams:
        tag = self.structural_tag
        return StructuredOutputsParams(
            json=self.json_schema,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
            structural_tag=orjson.dumps(tag).decode() if isinstance(tag, dict) else tag,
            disable_any_whitespace=self.disable_any_whitespace,
        )


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
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs' fields, honoured: a client that sends them gets
    # the constraint, not a 200 that ignored it.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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

    def structured_params(self) -> StructuredOutputsParams | None:
        """The constraint from `structured_outputs` or the `guided_*` fields (one of them)."""
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        guided = {k: v for k, v in guided.items() if v is not None}
        if guided and self.structured_outputs is not None:
            raise InvalidRequestError(
                "send structured_outputs or the guided_* fields, not both", "structured_outputs"
            )
        if guided:
            return StructuredOutputsParams(**guided)  # type: ignore[arg-type]
        return None if self.structured_outputs is None else self.structured_outputs.params()

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
        skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """Raises InvalidRequestError (HTTP 400) on combinations the engine refuses."""
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
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
            skip_special_tokens=skip,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured,
        )


PromptInput = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: PromptInput
    # OpenAI's default for completions is 16 tokens.
    max_tokens: JsonInt | None = Field(default=16, ge=1)
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # The prompt's text starts each choice's text (in a stream: its first chunk).
    echo: StrictBool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            # The prompt's own logprobs would need a prefill that keeps every position's logits.
            raise ValueError("echo with logprobs is not supported (the prompt has no logprobs)")
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


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    """An assistant message's earlier tool call, as the history sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        # Chat templates read the arguments as a mapping (`arguments | tojson`, `.items()`), as
        # transformers' apply_chat_template documents; text that is not JSON stays text.
        try:
            arguments: Any = orjson.loads(self.function.arguments)
        except orjson.JSONDecodeError:
            arguments = self.function.arguments
        call = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": call}


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, sent back (templates may render or drop it).
    reasoning_content: str | None = None

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
        role = "system" if self.role == "developer" else self.role
        content: Any = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        msg: dict[str, Any] = {"role": role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    def params(self, disable_any_whitespace: bool) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(
                json_object=True, disable_any_whitespace=disable_any_whitespace
            )
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_ or {"type": "object"}
            return StructuredOutputsParams(
                json=schema, disable_any_whitespace=disable_any_whitespace
            )
        return None


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
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools"
            )
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same function name")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools apply: "named" forces tool_choice's function; with tools and no
        tool_choice, "auto" (OpenAI's default)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

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
