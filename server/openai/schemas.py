"""OpenAI request and response shapes, and how a request maps onto the engine's SamplingParams.

Requests are validated strictly (no string-to-number coercion, unknown fields refused) as OpenAI does. Fields
that change generation but that the server cannot honour yet are refused by `check_supported()` with a 400 that
names them; fields with no effect on generation (`user`, `metadata`, `store`, ...) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from engine.request import SamplingParams
from server.openai.errors import invalid_request, unsupported_parameter

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FinishReasonName = Literal["stop", "length"]


class _RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class SamplingRequest(_RequestModel):
    """The fields chat and completions requests share."""

    model: str
    n: int | None = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2, description="0 means greedy; default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Choice i samples with seed + i.")
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to that token's logit."
    )
    user: str | None = None
    # Extras, as in vLLM.
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables top-k.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    priority: int = Field(
        0,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Lower runs first; only with `ferry serve --scheduling-policy priority` (400 otherwise).",
    )

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise a 400 naming the first field whose meaning the server cannot honour."""
        if self.stream_options is not None:
            if not self.stream:
                raise invalid_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
            if self.stream_options.include_obfuscation:
                raise unsupported_parameter("stream_options.include_obfuscation")

    def sampling_params(
        self, *, max_new_tokens: int, choice_index: int, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        if self.min_tokens and self.min_tokens > max_new_tokens:
            raise invalid_request(
                f"'min_tokens' ({self.min_tokens}) is larger than the token limit ({max_new_tokens}).", "min_tokens"
            )
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            # n choices of one request must differ yet stay reproducible: choice i uses seed + i.
            seed=None if self.seed is None else self.seed + choice_index,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logit_bias=self._logit_bias(),
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt-token logprob to ask the engine for; None: the prompt is not scored."""
        return None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's string keys as token ids (the engine checks they are in the vocabulary)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise invalid_request(f"'logit_bias' keys must be token ids, got {key!r}.", "logit_bias")
            bias.append((int(key), value))
        return tuple(bias)


# ------------------------------------------------------------------------------------------------ chat


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Fields the SDK echoes back on assistant messages: accepted while empty, refused when they carry tool use.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: whatever context remains.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # No effect on generation: accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # Known to OpenAI but not honoured here: refused by check_supported() unless empty.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        unsupported = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none"),
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "audio": self.audio is not None,
            "modalities": self.modalities not in (None, ["text"]),
            "prediction": self.prediction is not None,
            "reasoning_effort": self.reasoning_effort is not None,
            "verbosity": self.verbosity is not None,
            "web_search_options": self.web_search_options is not None,
        }
        for name, refused in unsupported.items():
            if refused:
                raise unsupported_parameter(name)
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported_parameter("response_format", "only {'type': 'text'} is available.")
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template expects it: role and plain-text content."""
        rendered = []
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role in ("tool", "function"):
                raise unsupported_parameter(f"{where}.role", f"'{message.role}' messages need tool support.")
            if message.tool_calls or message.function_call is not None:
                raise unsupported_parameter(f"{where}.tool_calls")
            if message.audio is not None:
                raise unsupported_parameter(f"{where}.audio")
            entry: dict[str, Any] = {
                # Templates know "system"; OpenAI's "developer" role is its newer name for the same thing.
                "role": "system" if message.role == "developer" else message.role,
                "content": _message_text(message, where),
            }
            if message.name is not None:
                entry["name"] = message.name
            rendered.append(entry)
        return rendered


def _message_text(message: ChatMessage, where: str) -> str:
    if message.content is None:
        return message.refusal or ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise unsupported_parameter(f"{where}.content[{j}].type", f"'{part.type}' parts (only text is).")
        texts.append(part.text)
    return "".join(texts)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReasonName


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: `{"content": "x"}`, and `{}` in a choice's last chunk.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    """Present (null) in every chunk only with stream_options.include_usage; set in the final chunk."""


# ------------------------------------------------------------------------------------------------ completions


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def prompt_logprobs(self) -> int | None:
        # echo with logprobs reports the prompt's tokens too, as OpenAI does.
        return self.logprobs if self.echo and self.logprobs is not None else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported_parameter("suffix")
        if self.best_of not in (None, 1):
            raise unsupported_parameter("best_of", "only best_of=1 is available.")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """None for an echoed prompt's first token, which nothing precedes."""
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ------------------------------------------------------------------------------------------------ models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferry"
    max_model_len: int
    tensor_parallel_size: int | None = None
    """Ranks the model is sharded over, when it is (the field is absent for a model on one device)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
