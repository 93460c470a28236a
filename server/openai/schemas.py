"""OpenAI request and response shapes, and how a request maps onto the engine's SamplingParams.

Requests are validated strictly (no string-to-number coercion, unknown fields refused) as OpenAI does; a number
that JSON writes with a zero fraction (`2.0`) is the integer it equals, as JSON Schema has it. Fields
that change generation but that the server cannot honour yet are refused by `check_supported()` with a 400 that
names them; fields with no effect on generation (`user`, `metadata`, `store`, ...) are accepted. Tools and output
constraints are turned into what the engine runs by server/openai/tools.py and structured.py.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, NonNegativeInt, Tag, model_validator

from engine.core.request import SamplingParams, StructuredOutput
from server.openai.errors import invalid_request, unsupported_parameter
from server.openai.images import IMAGE_PART, ImageRef
from server.openai.structured import (
    Constraint,
    conflicting_constraints,
    json_object_constraint,
    json_schema_constraint,
    vllm_constraint,
)
from server.openai.template import ReasoningEffort, template_kwargs
from server.openai.tools import ForcedFunction, FunctionTool, ToolChoiceMode, template_tool_calls

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FinishReasonName = Literal["stop", "length"]
ChatFinishReasonName = Literal["stop", "length", "tool_calls"]
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function and response-format names."""


class _RequestModel(BaseModel):
    # No infinities or NaNs (Python's JSON parser reads `1e400` and `NaN`): every number must mean something.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_values(cls, data: Any) -> Any:
        return _checked_json(data, "")


def _checked_json(value: Any, where: str) -> Any:
    """The request body as JSON means it, checked before the fields are: `where` is the value's path.

    - A number written with a fraction that it does not have (`2.0`) is the integer it equals: JSON Schema, and so
      the OpenAPI document, counts it as an integer, and clients that serialise every number as a float send it.
    - A lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but no character) is refused with a 400 naming the exact
      field; no tokenizer, response or log line could encode it.

    Measured, since it sees every byte of every body: a list of token ids costs one C-level pass over their types
    (400k ids: ~30 ms on a busy 2-core machine, where the whole request's validation takes ~0.6 s) and a string one
    UTF-8 encode (7 MB of ASCII: ~1 ms); never a Python step per item or character.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            surrogate = f"U+{ord(value[exc.start]):04X}"
            # Raised as the API's error itself (pydantic passes it through), so that it names the exact field.
            raise invalid_request(
                f"Invalid value for '{where or 'body'}': it holds a lone UTF-16 surrogate ({surrogate}), which is not "
                "a character; text must be valid Unicode.",
                where or None,
                code="invalid_unicode",
            ) from None
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        if set(map(type, value)) <= {int}:  # token ids: nothing to check, and no Python step per item
            return value
        return [_checked_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        checked = {}
        for key, item in value.items():
            name = f"{where}.{key}" if where else str(key)
            checked[_checked_json(key, name)] = _checked_json(item, name)
        return checked
    return value


def _omitted_when_none(description: str | None = None) -> Any:
    """A field left out of the JSON while None (streamed deltas carry only what they have), not sent as null."""
    return Field(None, description=description, exclude_if=lambda value: value is None)


def _tagged_by_type(tags: dict[str, str]) -> Discriminator:
    """Pick a union member by the object's `type`. The tags are class-like names, so that an error's `param`
    names the fields only (server/app.py leaves such segments out)."""

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    return Discriminator(
        tag,
        custom_error_type="invalid_value",
        custom_error_message=f"'type' must be one of {', '.join(repr(t) for t in tags)}",
    )


class StreamOptions(_RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's extra: every chunk carries the usage so far (with include_usage)."
    )


class StructuredOutputsParams(_RequestModel):
    """vLLM's `structured_outputs`: exactly one constraint on the whole output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON Schema (object or its text).")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="A grammar in llguidance's Lark dialect (`start: ...`).")
    json_object: bool | None = Field(None, description="true: any JSON object.")


def check_min_tokens(min_tokens: int, max_new_tokens: int, constrained: bool) -> None:
    """`min_tokens` fits the token limit, and no constraint (once met only EOS may follow, so nothing can be kept
    from ending there)."""
    if min_tokens > max_new_tokens:
        raise invalid_request(
            f"'min_tokens' ({min_tokens}) is larger than the token limit ({max_new_tokens}).", "min_tokens"
        )
    if constrained and min_tokens:
        raise invalid_request("'min_tokens' cannot go with a constrained output, which ends with EOS.", "min_tokens")


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
    stop_token_ids: list[NonNegativeInt] | None = None
    priority: int = Field(
        0,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Lower runs first; only with `ferry serve --scheduling-policy priority` (400 otherwise).",
    )
    close_within_budget: bool = Field(
        True,
        description="JSON output (response_format, structured_outputs JSON, a required or named tool call) closes "
        "within the token limit: when the tokens left are just enough for the value's shortest valid completion, "
        "that completion is forced and the answer ends with finish_reason 'length'. false: it may end unclosed.",
    )
    speculate: bool = Field(
        True,
        description="Ferry's extra: false keeps the server from drafting tokens for this request "
        "(--speculative-config); its output is the same either way.",
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="Constrain the output (vLLM's extra): one of json, regex, choice, grammar, json_object."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Older vLLM form of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Older vLLM form of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Older vLLM form of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Older vLLM form of structured_outputs.grammar.")

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

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's `continuous_usage_stats`, with `include_usage`)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_supported(self, template_options: Collection[str] = ()) -> None:
        """Raise a 400 naming the first field whose meaning the server cannot honour; `template_options` are the
        variables the model's chat template reads that a request may set (Tokenizer.chat_template_options)."""
        if self.stream_options is not None:
            if not self.stream:
                raise invalid_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
            if self.stream_options.include_obfuscation:
                raise unsupported_parameter("stream_options.include_obfuscation")

    def vllm_constraint(self) -> Constraint | None:
        """The constraint of `structured_outputs` or a `guided_*` field, if the request has one."""
        guided = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        extras = self.structured_outputs
        return vllm_constraint(
            None if extras is None else extras.model_dump(by_alias=True, exclude_none=True),
            {name: value for name, value in guided.items() if value is not None},
        )

    def sampling_params(
        self,
        *,
        max_new_tokens: int,
        choice_index: int,
        logprobs: bool,
        top_logprobs: int,
        structured_output: StructuredOutput | None = None,
    ) -> SamplingParams:
        check_min_tokens(self.min_tokens or 0, max_new_tokens, structured_output is not None)
        if structured_output is not None and self.ignore_eos:
            raise invalid_request(
                "'ignore_eos' cannot go with a constrained output, which ends with EOS.", "ignore_eos"
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
            structured_output=structured_output,
            close_within_budget=self.close_within_budget,
            speculate=self.speculate,
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


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(description="A data: URL (base64 PNG, JPEG, WebP or GIF) or an http(s) URL the server may "
                     "fetch (--allowed-media-domains).")  # fmt: skip
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="Accepted; the model's own processor sets the resolution."
    )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class PredictionContent(_RequestModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat for the most part (a file being edited)."""

    type: Literal["content"]
    content: str | list[ContentPart] = Field(
        description="The predicted output: drafts for speculative decoding, verified by the model, so the answer "
        "is the same as without it; what it gets right comes faster."
    )

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else _parts_text(self.content, "prediction")


class FunctionDefinition(_RequestModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object; absent means no arguments."
    )
    strict: bool | None = Field(None, description="Arguments are always enforced by the grammar when a call is.")


class ChatTool(_RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_RequestModel):
    name: str


class NamedToolChoice(_RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments object as JSON text.")


class ToolCall(BaseModel):
    """A call in a response, and in the assistant messages a client sends back."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls (rendered by the template).")
    tool_call_id: str | None = Field(None, description="On a tool message: the call it answers.")
    reasoning_content: str | None = Field(
        None, description="An assistant's reasoning in an earlier turn (the template shows it where it shows any)."
    )
    # Fields the SDK echoes back on assistant messages: accepted while empty, refused when they carry what the
    # server cannot render.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class ResponseFormatText(_RequestModel):
    type: Literal["text"]


class ResponseFormatJSONObject(_RequestModel):
    type: Literal["json_object"]


class JSONSchemaFormat(_RequestModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema every answer validates against.")
    strict: bool | None = Field(None, description="The schema is always enforced, strict or not.")


class ResponseFormatJSONSchema(_RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("TextFormat")]
    | Annotated[ResponseFormatJSONObject, Tag("JSONObjectFormat")]
    | Annotated[ResponseFormatJSONSchema, Tag("JSONSchemaFormat")],
    _tagged_by_type({"text": "TextFormat", "json_object": "JSONObjectFormat", "json_schema": "JSONSchemaFormat"}),
]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: whatever context remains.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(None, description="Function tools, shown to the model by its chat template.")
    tool_choice: ToolChoice | None = Field(
        None,
        description="Default 'auto' with tools, 'none' without. 'required' and a named function are enforced by "
        "the grammar; 'auto' parses the model's own call format (`--tool-call-parser`).",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer.")
    response_format: ResponseFormat | None = None
    # No effect on generation: accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Known to OpenAI but not honoured here: refused by check_supported() unless empty.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: PredictionContent | None = Field(
        None,
        description="Predicted Outputs: the tokens of its content are drafted where the answer follows them; "
        "usage.completion_tokens_details counts the accepted and rejected ones (rejected ones are billed in "
        "completion_tokens, as OpenAI does).",
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="Passed to the chat template as `reasoning_effort`; refused unless the template reads it."
    )
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Extras, as in vLLM.
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='Variables for the model\'s chat template (e.g. `{"enable_thinking": false}`); a name the '
        "template does not read is refused.",
    )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self, template_options: Collection[str] = ()) -> None:
        super().check_supported(template_options)
        self.template_kwargs(template_options)
        unsupported = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none"),
            "audio": self.audio is not None,
            "modalities": self.modalities not in (None, ["text"]),
            "verbosity": self.verbosity is not None,
            "web_search_options": self.web_search_options is not None,
        }
        for name, refused in unsupported.items():
            if refused:
                raise unsupported_parameter(name)
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")

    def template_kwargs(self, template_options: Collection[str]) -> dict[str, Any]:
        """What the chat template gets beyond the messages (a 400 for what it would not read)."""
        return template_kwargs(
            self.chat_template_kwargs,
            self.reasoning_effort,
            effort_param="reasoning_effort",
            template_options=template_options,
        )

    def function_tools(self) -> list[FunctionTool]:
        return [
            FunctionTool(tool.function.name, tool.function.description, tool.function.parameters)
            for tool in self.tools or ()
        ]

    def tool_choice_value(self) -> ToolChoiceMode | ForcedFunction | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return ForcedFunction(self.tool_choice.function.name)
        return self.tool_choice

    def response_format_constraint(self) -> Constraint | None:
        response_format = self.response_format
        if isinstance(response_format, ResponseFormatJSONObject):
            return json_object_constraint("response_format")
        if isinstance(response_format, ResponseFormatJSONSchema):
            return json_schema_constraint(response_format.json_schema.schema_, "response_format.json_schema.schema")
        return None

    def output_constraint(self) -> Constraint | None:
        """The one constraint on the answer's format: `response_format` or vLLM's extras (tools add theirs)."""
        found = [c for c in (self.response_format_constraint(), self.vllm_constraint()) if c is not None]
        if len(found) > 1:
            raise conflicting_constraints(found[0].param, found[1].param)
        return found[0] if found else None

    def template_messages(self, images: list[ImageRef] | None = None) -> list[dict[str, Any]]:
        """The conversation as the chat template expects it: role, plain-text content, and tool use in the shape
        Hugging Face templates take (`tool_calls` with object arguments; a tool message's `tool_call_id`, and the
        called function's `name`). With `images`, a user message's `image_url` parts are collected there, in
        order, and its content becomes the list of text and image parts templates place images by; without,
        image parts are refused."""
        rendered = []
        called: dict[str, str] = {}
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            if message.role == "function":
                raise unsupported_parameter(f"{where}.role", "the deprecated 'function' messages (use tools).")
            if message.function_call is not None:
                raise unsupported_parameter(f"{where}.function_call", "the deprecated form (use tool_calls).")
            if message.audio is not None:
                raise unsupported_parameter(f"{where}.audio")
            entry: dict[str, Any] = {
                # Templates know "system"; OpenAI's "developer" role is its newer name for the same thing.
                "role": "system" if message.role == "developer" else message.role,
                "content": _message_content(message, where, images),
            }
            if message.name is not None:
                entry["name"] = message.name
            if message.reasoning_content is not None:
                if message.role != "assistant":
                    raise invalid_request(
                        f"'{where}.reasoning_content' is only allowed on assistant messages.",
                        f"{where}.reasoning_content",
                    )
                entry["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                if message.role != "assistant":
                    raise invalid_request(
                        f"'{where}.tool_calls' is only allowed on assistant messages.", f"{where}.tool_calls"
                    )
                calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
                entry["tool_calls"] = template_tool_calls(calls)
                called.update((c.id, c.function.name) for c in message.tool_calls)
            if message.role == "tool":
                if message.tool_call_id is None:
                    raise invalid_request(
                        f"Missing required parameter: '{where}.tool_call_id'.",
                        f"{where}.tool_call_id",
                        code="missing_required_parameter",
                    )
                if message.tool_call_id not in called:
                    raise invalid_request(
                        f"'{where}.tool_call_id' ({message.tool_call_id!r}) answers no tool call of an earlier "
                        "assistant message.",
                        f"{where}.tool_call_id",
                    )
                entry["tool_call_id"] = message.tool_call_id
                entry.setdefault("name", called[message.tool_call_id])
            rendered.append(entry)
        return rendered


def _message_content(message: ChatMessage, where: str, images: list[ImageRef] | None) -> str | list[dict[str, Any]]:
    if message.content is None:
        return message.refusal or ""
    if isinstance(message.content, str):
        return message.content
    if images is None or message.role != "user" or not any(part.type == "image_url" for part in message.content):
        return _parts_text(message.content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(message.content):
        place = f"{where}.content[{j}]"
        if part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "image_url" and part.image_url is not None:
            images.append(ImageRef(part.image_url.url, f"{place}.image_url.url", part.image_url.detail))
            parts.append(dict(IMAGE_PART))
        elif part.type == "image_url":
            raise invalid_request(f"Missing required parameter: '{place}.image_url'.", f"{place}.image_url",
                                  code="missing_required_parameter")  # fmt: skip
        else:
            raise unsupported_parameter(f"{place}.type", f"'{part.type}' parts (text and image_url are).")
    return parts


def _parts_text(parts: list[ContentPart], where: str) -> str:
    """Text parts joined; any other kind of part is refused by its place (`where.content[j]`)."""
    texts = []
    for j, part in enumerate(parts):
        if part.type != "text" or part.text is None:
            raise unsupported_parameter(f"{where}.content[{j}].type", f"'{part.type}' parts (only text is).")
        texts.append(part.text)
    return "".join(texts)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None,
        description="Set for a chat completion with a `prediction` (absent otherwise).",
        exclude_if=lambda v: v is None,
    )


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
    content: str | None = Field(description="The answer's text; null when it is only tool calls.")
    refusal: str | None = None
    reasoning_content: str | None = _omitted_when_none(
        "The model's reasoning (with --reasoning-parser), kept out of `content`; as in vLLM."
    )
    tool_calls: list[ToolCall] | None = _omitted_when_none("Present when the answer calls tools.")


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReasonName = Field(description="'tool_calls' when the answer ended with tool calls.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallChunk(BaseModel):
    name: str | None = _omitted_when_none("In a call's first chunk only.")
    arguments: str = Field(description="The next piece of the arguments' JSON text ('' in the first chunk).")


class ToolCallChunk(BaseModel):
    index: int = Field(description="Which call of the choice; its pieces share it.")
    id: str | None = _omitted_when_none("In a call's first chunk only, with `type` and `function.name`.")
    type: Literal["function"] | None = _omitted_when_none()
    function: FunctionCallChunk


class ChatDelta(BaseModel):
    """A delta carries only what changed: `{"content": "x"}`, and `{}` in a choice's last chunk."""

    role: Literal["assistant"] | None = _omitted_when_none()
    content: str | None = _omitted_when_none()
    reasoning_content: str | None = _omitted_when_none("The next piece of the reasoning (with --reasoning-parser).")
    tool_calls: list[ToolCallChunk] | None = _omitted_when_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: ChatFinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    """Present (null) in every chunk only with stream_options.include_usage; set in the final chunk."""


# ------------------------------------------------------------------------------------------------ completions


_T = TypeVar("_T")
_NonEmpty = Annotated[_T, Field(min_length=1)]
_Text = _NonEmpty[str]
_TokenIds = _NonEmpty[list[NonNegativeInt]]


class CompletionRequest(SamplingRequest):
    prompt: (
        _Text
        | Annotated[list[_Text], Field(min_length=1)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def prompt_logprobs(self) -> int | None:
        # echo with logprobs reports the prompt's tokens too, as OpenAI does.
        return self.logprobs if self.echo and self.logprobs is not None else None

    def check_supported(self, template_options: Collection[str] = ()) -> None:
        super().check_supported(template_options)
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


class ModelPooling(BaseModel):
    """What a pooling model makes, on its card."""

    kind: Literal["embed", "classify", "yes_no"] = Field(
        description="embed: embeddings (/v1/embeddings; /v1/score and /v1/rerank by cosine similarity); classify: a "
        "cross-encoder's scores (/v1/score, /v1/rerank); yes_no: a causal LM's P(yes) (--reranker-tokens)."
    )
    dimensions: int = Field(description="The embedding's size; a classifier's labels; 1 for yes/no.")
    matryoshka_dimensions: list[int] | None = _omitted_when_none("Sizes an embedding request may ask for.")
    generates: bool = Field(description="The model also serves chat, completions and responses.")


class ModelGGUF(BaseModel):
    """The GGUF file a model was read from, on its card."""

    file: str = Field(description="The file's name.")
    tensor_types: dict[str, int] = Field(description="How many of its tensors are of each GGML type.")
    dequantized: list[str] = Field(
        description="Its quantized types dequantized as they loaded (some of their tensors)."
    )
    kept: list[str] = Field(
        description="Its quantized types a kernel runs as they are (some of their tensors): Q4_0 as int4, Q8_0 as int8 "
        "in groups."
    )


class ModelCheckpointQuantization(BaseModel):
    """How a quantized checkpoint stores its weights, on its card."""

    format: str = Field(description="The checkpoint's `quant_method` (compressed-tensors, gptq, awq), or gguf.")
    weights: str = Field(description="What it holds, in words (bits, groups, symmetry, activations).")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferry"
    root: str | None = None
    """A LoRA adapter's directory (the field is absent for the base model)."""
    parent: str | None = None
    """The served model a LoRA adapter adapts (absent for the base model)."""
    max_model_len: int
    tensor_parallel_size: int | None = None
    """Ranks the model is sharded over, when it is (the field is absent for a model on one device)."""
    quantization: str
    """The scheme whose kernels run the decoder's linear weights (`none`, `int8`, `int8-dynamic`, `int4`, `fp8`):
    `--quantization`'s, or a quantized checkpoint's."""
    checkpoint_quantization: ModelCheckpointQuantization | None = None
    """The quantized checkpoint's format (the field is absent for weights stored in floats)."""
    weight_bytes: int
    """Bytes of the weights as stored (quantized codes and scales included), on each rank."""
    kv_cache_dtype: str
    """What the KV cache stores K and V in (`float8_e4m3fn` under --kv-cache-dtype fp8, else the model's dtype)."""
    pooling: ModelPooling | None = None
    """What the model pools (the field is absent for a model that only generates)."""
    gguf: ModelGGUF | None = None
    """The GGUF file the model was read from (the field is absent for a model directory)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
