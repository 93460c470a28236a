"""The Responses API's shapes (`POST /v1/responses`): the request, its input items, and the response object.

Requests are validated as strictly as chat's. Responses are stored (`store`, server/state/responses.py), chained
by `previous_response_id` or kept in a `conversation` (server/state/conversations.py), and run in the `background`
if asked; item references are refused by `check_supported()`, as is every field whose meaning it cannot honour
(hosted tools, images, logprobs, reasoning summaries, ...).
Input items, content parts, tools and formats of kinds the server does not support parse into `UnsupportedKind`,
so that the refusal names the field and the kind rather than failing validation in a way that hides why.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, NonNegativeInt, Tag
from pydantic.json_schema import SkipJsonSchema

from engine.core.request import SamplingParams, StructuredOutput
from server.openai.errors import invalid_request, unsupported_parameter
from server.openai.schemas import FUNCTION_NAME_PATTERN, INT32_MAX, INT32_MIN, check_min_tokens
from server.openai.structured import Constraint, json_object_constraint, json_schema_constraint
from server.openai.template import ReasoningEffort, template_kwargs
from server.openai.tools import ForcedFunction, FunctionTool, ToolChoiceMode

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class UnsupportedKind(BaseModel):
    """An object of a kind the server does not support: parsed only so that its refusal (a 400) can name it, and
    left out of the unions' schemas, which list what is supported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _by_type(tags: dict[str, str], default: str | None = None) -> Discriminator:
    """Pick a union member by the object's `type` (`default` where it has none), through `tags` from type to
    member tag; unknown types go to `UnsupportedKind`. The tags are class-like names, so that an error's `param`
    names the fields only (server/app.py leaves such segments out)."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return tags.get(kind, "Unsupported") if isinstance(kind, str) else "Unsupported"

    return Discriminator(tag)


# ------------------------------------------------------------------------------------------------ input


def _text_or_list() -> Discriminator:
    """`str | list[...]` fields: validate against one member only, so that an error inside the list names where."""
    return Discriminator(lambda value: "Text" if isinstance(value, str) else "List")


class InputText(_RequestModel):
    type: Literal["input_text"]
    text: str


class InputImage(_RequestModel):
    type: Literal["input_image"]
    image_url: str | None = Field(
        None, description="A data: URL (base64 PNG, JPEG, WebP or GIF) or an http(s) URL the server may fetch."
    )
    file_id: str | None = Field(None, description="Not supported: send the image as image_url.")
    detail: Literal["auto", "low", "high"] | None = None


class OutputTextPart(_RequestModel):
    """An assistant's text, as a client sends back an earlier response's output."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(_RequestModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    Annotated[InputText, Tag("InputText")]
    | Annotated[InputImage, Tag("InputImage")]
    | Annotated[OutputTextPart, Tag("OutputTextPart")]
    | Annotated[RefusalPart, Tag("RefusalPart")]
    | Annotated[SkipJsonSchema[UnsupportedKind], Tag("Unsupported")],
    _by_type(
        {
            "input_text": "InputText",
            "input_image": "InputImage",
            "output_text": "OutputTextPart",
            "refusal": "RefusalPart",
        }
    ),
]


Content = Annotated[Annotated[str, Tag("Text")] | Annotated[list[ContentPart], Tag("List")], _text_or_list()]


class MessageItem(_RequestModel):
    """A message: `{"role", "content"}` (the easy form, no `type`), or an earlier response's output message."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_RequestModel):
    """A call the model made in an earlier turn (sent back with its result, a function_call_output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments object as JSON text.")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_RequestModel):
    """A tool's result: rendered as the chat template's tool message answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningTextPart(_RequestModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(_RequestModel):
    type: Literal["summary_text"]
    text: str


class ReasoningInputItem(_RequestModel):
    """An earlier turn's reasoning: the template gets it as the next assistant message's `reasoning_content`."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningInputItem, Tag("ReasoningInputItem")]
    | Annotated[SkipJsonSchema[UnsupportedKind], Tag("Unsupported")],
    _by_type(
        {
            "message": "MessageItem",
            "function_call": "FunctionCallItem",
            "function_call_output": "FunctionCallOutputItem",
            "reasoning": "ReasoningInputItem",
        },
        default="message",
    ),
]


Input = Annotated[Annotated[str, Tag("Text")] | Annotated[list[InputItem], Tag("List")], _text_or_list()]


# ------------------------------------------------------------------------------------------------ tools, text


class ResponsesFunctionTool(_RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments object; absent means no arguments."
    )
    strict: bool | None = Field(None, description="Arguments are always enforced by the grammar when a call is.")


Tool = Annotated[
    Annotated[ResponsesFunctionTool, Tag("FunctionTool")]
    | Annotated[SkipJsonSchema[UnsupportedKind], Tag("Unsupported")],
    _by_type({"function": "FunctionTool"}),
]


class FunctionToolChoice(_RequestModel):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Annotated[FunctionToolChoice, Tag("FunctionToolChoice")]
    | Annotated[SkipJsonSchema[UnsupportedKind], Tag("Unsupported")],
    _by_type({"function": "FunctionToolChoice"}),
]


class TextFormatText(_RequestModel):
    type: Literal["text"]


class TextFormatJSONObject(_RequestModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(_RequestModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema the answer validates against.")
    description: str | None = None
    strict: bool | None = Field(None, description="The schema is always enforced, strict or not.")


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("TextFormat")]
    | Annotated[TextFormatJSONObject, Tag("JSONObjectFormat")]
    | Annotated[TextFormatJSONSchema, Tag("JSONSchemaFormat")]
    | Annotated[SkipJsonSchema[UnsupportedKind], Tag("Unsupported")],
    _by_type({"text": "TextFormat", "json_object": "JSONObjectFormat", "json_schema": "JSONSchemaFormat"}),
]


class TextConfig(_RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_RequestModel):
    effort: ReasoningEffort | None = Field(
        None, description="Passed to the chat template as `reasoning_effort`; refused unless the template reads it."
    )
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_RequestModel):
    include_obfuscation: bool | None = None


class ConversationParam(_RequestModel):
    id: str = Field(description="conv_...")


# ------------------------------------------------------------------------------------------------ request


class ResponsesRequest(_RequestModel):
    model: str
    input: Input = Field(description="A user message's text, or the conversation's items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: whatever context remains.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 means greedy; default 1.")
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[Tool] | None = Field(None, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = Field(
        None,
        description="Default 'auto' with tools. 'required' and a named function are enforced by the grammar; "
        "'auto' parses the model's own call format (`--tool-call-parser`).",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per answer.")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = Field(
        None, description="Keep the response for retrieval and `previous_response_id` (default true, as OpenAI's)."
    )
    # Extras, as in vLLM's chat and completions.
    min_tokens: int | None = Field(0, ge=0, description="Tokens to generate before EOS or a stop token may end it.")
    stop_token_ids: list[NonNegativeInt] | None = Field(None, description="Token ids that end the answer.")
    close_within_budget: bool = Field(
        True,
        description="JSON output (response_format, structured_outputs JSON, a required or named tool call) closes "
        "within the token limit: when the tokens left are just enough for the value's shortest valid completion, "
        "that completion is forced and the answer ends with status 'incomplete'. false: it may end unclosed.",
    )
    priority: int = Field(
        0,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Lower runs first; only with `ferry serve --scheduling-policy priority` (400 otherwise).",
    )
    # No effect on generation: accepted (metadata is echoed).
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: str | None = None
    previous_response_id: str | None = Field(
        None, description="A stored response this one continues: its conversation comes before `input`."
    )
    conversation: str | ConversationParam | None = Field(
        None,
        description="A conversation (its id): its items come before `input`, and this turn's input and output items "
        "are added to it when the response ends. Not with `previous_response_id`.",
    )
    background: bool | None = Field(
        None,
        description="Answer at once with the response `queued`, generate it in the background: poll GET "
        "/v1/responses/{id}, cancel by POST /v1/responses/{id}/cancel. Needs `store`. With `stream`, the answer is "
        "its event stream, which goes on without a client, and GET /v1/responses/{id}?stream=true&starting_after=N "
        "picks it up again from any replica.",
    )
    # Known to OpenAI but not honoured here: refused by check_supported() unless empty.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    # What the generation core reads of any request (server/openai/generation.py's GenerationRequest).
    @property
    def num_choices(self) -> int:
        return 1

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationParam) else self.conversation

    @property
    def stop_strings(self) -> list[str]:
        return []

    @property
    def include_usage(self) -> bool:
        return False  # a response's usage is always in its last event

    @property
    def continuous_usage(self) -> bool:
        return False

    def check_supported(self, template_options: Collection[str] = ()) -> None:
        """Raise a 400 naming the first field whose meaning the server cannot honour."""
        if self.conversation is not None and self.previous_response_id is not None:
            raise invalid_request(
                "Mutually exclusive parameters: provide either 'previous_response_id' or 'conversation', not both.",
                "conversation",
                code="mutually_exclusive_parameters",
            )
        if self.background and self.store is False:
            raise invalid_request("A background response is stored: 'background' needs 'store' true.", "background")
        unsupported = {
            "include": bool(self.include),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
            "prompt": self.prompt is not None,
            "truncation": self.truncation == "auto",
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
            "reasoning.summary": self.reasoning is not None and self.reasoning.summary is not None,
            "reasoning.generate_summary": self.reasoning is not None and self.reasoning.generate_summary is not None,
            "stream_options.include_obfuscation": bool(self.stream_options and self.stream_options.include_obfuscation),
        }
        for name, refused in unsupported.items():
            if refused:
                raise unsupported_parameter(name)
        if self.stream_options is not None and not self.stream:
            raise invalid_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, UnsupportedKind):
                raise unsupported_parameter(f"tools[{i}].type", f"'{tool.type}' tools (only function tools are).")
        if isinstance(self.tool_choice, UnsupportedKind):
            raise unsupported_parameter("tool_choice.type", f"'{self.tool_choice.type}' (only function tools are).")
        if self.text is not None and isinstance(self.text.format, UnsupportedKind):
            raise unsupported_parameter("text.format.type", f"'{self.text.format.type}' formats.")
        self.template_kwargs(template_options)

    def template_kwargs(self, template_options: Collection[str]) -> dict[str, Any]:
        """What the chat template gets beyond the messages: the reasoning effort, if asked for."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return template_kwargs(None, effort, effort_param="reasoning.effort", template_options=template_options)

    def function_tools(self) -> list[FunctionTool]:
        return [
            FunctionTool(tool.name, tool.description, tool.parameters)
            for tool in self.tools or ()
            if isinstance(tool, ResponsesFunctionTool)
        ]

    def tool_choice_value(self) -> ToolChoiceMode | ForcedFunction | None:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return ForcedFunction(self.tool_choice.name)
        return self.tool_choice if isinstance(self.tool_choice, str) else None

    def format_constraint(self) -> Constraint | None:
        text_format = self.text.format if self.text is not None else None
        if isinstance(text_format, TextFormatJSONObject):
            return json_object_constraint("text.format")
        if isinstance(text_format, TextFormatJSONSchema):
            return json_schema_constraint(text_format.schema_, "text.format.schema")
        return None

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
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens or 0,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            structured_output=structured_output,
            close_within_budget=self.close_within_budget,
        )


# ------------------------------------------------------------------------------------------------ response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(description="msg_...")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning (with --reasoning-parser), as text; never summarized nor encrypted here."""

    id: str = Field(description="rs_...")
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallOutput(BaseModel):
    id: str = Field(description="fc_...")
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str = Field(description="What the tool's function_call_output answers.")
    name: str
    arguments: str = Field(description="The arguments object as JSON text.")


OutputItem = Annotated[ReasoningItem | OutputMessage | FunctionCallOutput, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Output tokens up to and including the one that closed the reasoning.")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseConversation(BaseModel):
    id: str = Field(description="The conversation the response's input and output items were added to.")


class EchoedFunctionTool(BaseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class EchoedTextConfig(BaseModel):
    format: dict[str, Any] = Field(description="The request's text.format, or {'type': 'text'}.")


class EchoedReasoning(BaseModel):
    effort: ReasoningEffort | None = None
    summary: None = None


class ResponseObject(BaseModel):
    id: str = Field(description="resp_...")
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = Field(
        None, description="Set when the token limit (max_output_tokens, or the context) cut the answer short."
    )
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: EchoedReasoning
    store: bool = True
    temperature: float
    text: EchoedTextConfig
    tool_choice: str | dict[str, Any]
    tools: list[EchoedFunctionTool]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    conversation: ResponseConversation | None = None
