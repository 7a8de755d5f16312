"""OpenAI-compatible request and response messages (pydantic), plus vLLM's /tokenize and /detokenize.

Requests are validated strictly (a string where a number belongs is a 400, not a silent coercion) and
unknown fields are ignored, as OpenAI-compatible servers usually do. Responses follow OpenAI's schemas
field for field, so the official client parses them; vLLM's sampling extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, priority,
cache_salt) are accepted on requests.

Long module: the OpenAI messages, one pydantic class each and no logic; requests and responses are
read side by side (a response mirrors its request's fields).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, model_serializer, with_config
from typing_extensions import TypedDict

from tokenloop.errors import InvalidRequestError
from tokenloop.request import SamplingParams
from tokenloop.serving.structured_fields import DeltaToolCall, ToolCall, structured_outputs_of
from tokenloop.structured.tool_calls import ToolChoice

MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and SamplingParams' on logprobs


def random_id(prefix: str) -> str:
    """An OpenAI-style id: `cmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    # Structured outputs (see tokenloop.serving.structured_fields): OpenAI's and vLLM's fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the request; raises InvalidRequestError naming the offending field."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        bias: dict[int, float] | None = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                              param="logit_bias") from None
                bias[token_id] = max(-100.0, min(100.0, value))  # OpenAI clamps to [-100, 100]
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            output_kind="delta",  # the server assembles responses from deltas: O(1) per step and token
        )


# ---- chat history: the shapes the tool-calling code and the templates rely on, checked before rendering
# (roles and content are checked by validation.check_messages; other keys go to the template as sent).

@with_config(ConfigDict(strict=True))
class HistoryFunction(TypedDict):
    """The function of an earlier assistant tool call: its name and its arguments as JSON text."""

    name: Annotated[str, Field(min_length=1)]
    arguments: str


@with_config(ConfigDict(strict=True, extra="allow"))
class HistoryToolCall(TypedDict):
    """One tool call of an earlier assistant turn."""

    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: HistoryFunction


@with_config(ConfigDict(strict=True, extra="allow"))
class ChatMessageParam(TypedDict):
    """A message of the conversation (validated to a plain dict)."""

    role: NotRequired[Any]
    content: NotRequired[Any]
    tool_calls: NotRequired[list[HistoryToolCall] | None]
    tool_call_id: NotRequired[str]


# Tried in order: under strict validation a value matches one member at most, and pydantic's default
# ("smart") mode validates a million token ids against every member, ~10x the time, holding the GIL.
PromptInput = Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch: one text, one token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be an empty list", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported (other than best_of == n)", param="best_of")
        # With echo, the prompt's own logprobs are part of the answer (OpenAI's behaviour).
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        params = self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)
        params.structured_outputs = structured_outputs_of(self)
        return params


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated by OpenAI: refused, pointing to tools
    function_call: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, tools: ToolChoice | None = None) -> SamplingParams:
        """SamplingParams of the chat request; `tools`: its tool mode, parsed by the caller (else here)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                      f"{self.top_logprobs}", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs)
        # response_format, structured_outputs, tools
        params.structured_outputs = structured_outputs_of(self, tools)
        return params

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages (rendered with the chat template first)."""

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    """A streamed piece of the assistant message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenloop"
    root: str | None = None  # what it serves: the base model's name, or a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model (None for the base model itself)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
