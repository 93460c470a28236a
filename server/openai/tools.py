"""Tools in a request: checked once, rendered into the chat template, and turned into what generates the calls.

`tool_choice` decides how: `none` offers no tool; `auto` lets the model answer or call in its own format, which
a tool-call parser reads (server/openai/tool_parsers); `required` and a named function are enforced by the
grammar, so the answer is always a call to an offered tool with arguments that validate. Where the grammar knows
the model's own format (Hermes: `call_tags`, read from its chat template), it enforces the calls in that format,
the one the model was trained on; `auto` beside a JSON `response_format` then means a call in that format or the
JSON answer (an agent with tools and a typed result), and `auto` alone free text or, once the model opens a
call, valid calls to offered tools (as OpenAI's strict function calling; not for a model with a reasoning
format, whose answer is split). Otherwise a `required` answer is a JSON array of `{"name", "parameters"}` objects
(one only with `parallel_tool_calls: false`), a named one the arguments object itself, and `auto` beside a
`response_format` is the JSON answer alone.

The functions take plain values (FunctionTool, a choice), so the chat and responses endpoints share them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from server.openai.errors import invalid_request
from server.openai.structured import (
    JSON_KINDS,
    Constraint,
    check_json_schema,
    conflicting_constraints,
    json_schema_constraint,
    tool_calls_constraint,
)
from server.openai.tool_parsers import TOOL_CALL_PARSERS
from server.openai.tool_parsers.base import ToolCallReader
from server.openai.tool_parsers.enforced import (
    ARGUMENTS_KEY,
    NAME_KEY,
    NamedCallReader,
    RequiredCallsReader,
    TaggedCallsReader,
)

ToolChoiceMode = Literal["none", "auto", "required"]
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments schema of a function declared without `parameters`."""


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments object; None means it takes none."""

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_ARGUMENTS

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=`): OpenAI's function-tool shape."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.arguments_schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ForcedFunction:
    """A named tool_choice: the answer is a call to this function."""

    name: str


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools mean for its prompt and its generation."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoiceMode | ForcedFunction
    parallel: bool
    parser: str | None
    """The model-format parser that reads `auto` answers."""
    tags: tuple[str, str] | None = None
    """The text around one call object in the model's own format, where the grammar can write calls as the
    model does (server/openai/tool_parsers/hermes.py call_tags)."""
    strict_auto: bool = False
    """`auto` answers are free text or, once the model opens a call, calls to offered tools whose arguments
    validate (as OpenAI's strict function calling): on where the server knows the tags and the model has no
    reasoning format (a constrained answer is not split into reasoning)."""

    @property
    def forced(self) -> bool:
        """The answer must be a call: `required` or a named function."""
        return isinstance(self.choice, ForcedFunction) or self.choice == "required"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the template renders as the offered tools: none when the answer may not call one."""
        if self.choice == "none":
            return None
        return [tool.template_entry() for tool in self.tools]

    def constraint(self, answer: Constraint | None, param: str = "tool_choice") -> Constraint | None:
        """The grammar of the answer: an enforced call (`required`, a named function), or with `auto` and a
        JSON `answer` (the request's `response_format`) a call or that answer; `answer` alone otherwise."""
        forced = self.forced
        if forced and answer is not None:
            raise conflicting_constraints(param, answer.param)
        tags = self.tags
        if self.choice == "auto" and answer is not None and tags is not None and answer.output.kind in JSON_KINDS:
            return tool_calls_constraint(tags, _tagged_call_schema(self.tools), self.parallel, answer, param)
        if self.choice == "auto" and answer is None and tags is not None and self.strict_auto:
            return tool_calls_constraint(tags, _tagged_call_schema(self.tools), self.parallel, None, param, text=True)
        if not forced:
            return answer
        if isinstance(self.choice, ForcedFunction):
            (tool,) = (t for t in self.tools if t.name == self.choice.name)
            if tags is not None:
                return tool_calls_constraint(tags, _tagged_call_schema((tool,)), False, None, param)
            return json_schema_constraint(tool.arguments_schema, param)
        if tags is not None:
            return tool_calls_constraint(tags, _tagged_call_schema(self.tools), self.parallel, None, param)
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(tool) for tool in self.tools]},
        }
        if not self.parallel:
            calls["maxItems"] = 1
        return json_schema_constraint(calls, param)

    def reader_factory(self) -> Callable[[], ToolCallReader] | None:
        """Makes one reader per choice (readers keep state); None when answers are plain content."""
        choice, tags = self.choice, self.tags
        if tags is not None and self.forced:  # enforced in the model's own format (`constraint`)
            return lambda: TaggedCallsReader(*tags)
        if isinstance(choice, ForcedFunction):
            return lambda: NamedCallReader(choice.name)
        if choice == "required":
            return RequiredCallsReader
        if choice == "auto" and self.parser is not None:
            return TOOL_CALL_PARSERS[self.parser]
        return None


def resolve_tool_use(
    tools: Sequence[FunctionTool] | None,
    choice: ToolChoiceMode | ForcedFunction | None,
    parallel_tool_calls: bool | None,
    parser: str | None,
    *,
    tags: tuple[str, str] | None = None,
    strict_auto: bool = False,
    tools_param: str = "tools",
    choice_param: str = "tool_choice",
    parameters_field: str = "function.parameters",
) -> ToolUse | None:
    """Check the tools and the choice together; None when the request offers no tools (or `tool_choice` none and
    no tools). `parser` is the server's parser for `auto` (None: it cannot read this model's calls), `tags` the
    model's own call format where the grammar can write it (ServingContext.call_tags), `strict_auto` whether
    `auto` calls are enforced too (ToolUse.strict_auto);
    `parameters_field` is where a tool keeps its schema (chat nests it under `function`, responses do not)."""
    tools = tuple(tools or ())
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request(f"'{choice_param}' needs 'tools' to choose from.", choice_param)
        return None
    names = [tool.name for tool in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.name) != i:
            raise invalid_request(f"'{tools_param}' names the function '{tool.name}' twice.", tools_param)
        if tool.parameters is not None:
            where = f"{tools_param}[{i}].{parameters_field}"
            if tool.parameters.get("type", "object") != "object":
                raise invalid_request(f"'{where}' must describe an object (type 'object').", where)
            check_json_schema(tool.parameters, where)
    choice = choice or "auto"
    if isinstance(choice, ForcedFunction) and choice.name not in names:
        raise invalid_request(
            f"'{choice_param}' names the function '{choice.name}', which is not among the tools ({', '.join(names)}).",
            choice_param,
        )
    if choice == "auto" and parser is None:
        raise invalid_request(
            "This server cannot read tool calls in this model's own format, which tool_choice 'auto' (the default "
            "with tools) needs: start it with --tool-call-parser (hermes, kimi_k2, llama3_json, mistral), or send "
            "tool_choice 'required' or a named function, which the grammar enforces.",
            choice_param,
            code="unsupported_tool_choice",
        )
    return ToolUse(tools, choice, parallel_tool_calls is not False, parser, tags, strict_auto)


def template_tool_calls(calls: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """An assistant message's calls, `(id, name, arguments as JSON text)`, as chat templates take them."""
    return [template_tool_call(call_id, name, arguments) for call_id, name, arguments in calls]


def template_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One call as chat templates take it: arguments as an object (templates write them with `tojson`), or, when
    the text is not a JSON object (a call cut off by its token limit, replayed by a client), the text as it is:
    templates that check for a string write it unchanged, and the conversation goes on."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    value: Any = parsed if isinstance(parsed, dict) else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


def _tagged_call_schema(tools: Sequence[FunctionTool]) -> dict[str, Any]:
    """One call object in the model's own format, `{"name", "arguments"}`, for any of `tools`."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.name]}, "arguments": tool.arguments_schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {NAME_KEY: {"type": "string", "enum": [tool.name]}, ARGUMENTS_KEY: tool.arguments_schema},
        "required": [NAME_KEY, ARGUMENTS_KEY],
        "additionalProperties": False,
    }
