"""What a request passes to the model's chat template beyond its messages: `chat_template_kwargs` and the reasoning
effort, each checked against the variables the template reads, so that nothing a client sets is silently unused;
and the rendering of a conversation, which chat and the Responses API share.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Literal

from server.openai.errors import invalid_request, unsupported_parameter
from server.tokens import ChatTemplateError, Tokenizer

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
EFFORT_VARIABLE = "reasoning_effort"
"""The template variable reasoning templates (gpt-oss's, for one) read the effort from."""


def template_kwargs(
    chat_template_kwargs: Mapping[str, Any] | None,
    reasoning_effort: str | None,
    *,
    effort_param: str,
    template_options: Collection[str],
) -> dict[str, Any]:
    """The template's extra variables, each one the template reads (`template_options`); `effort_param` names
    the request field the effort came in, for errors."""
    kwargs = dict(chat_template_kwargs or {})
    for name in kwargs:
        if name not in template_options:
            raise unsupported_parameter(
                f"chat_template_kwargs.{name}", f"this model's chat template does not read '{name}'."
            )
    if reasoning_effort is not None:
        if EFFORT_VARIABLE not in template_options:
            raise unsupported_parameter(effort_param, f"this model's chat template does not read '{EFFORT_VARIABLE}'.")
        if EFFORT_VARIABLE in kwargs:
            raise invalid_request(
                f"'{effort_param}' and 'chat_template_kwargs.{EFFORT_VARIABLE}' both set the reasoning effort; "
                "set one.",
                effort_param,
            )
        kwargs[EFFORT_VARIABLE] = reasoning_effort
    return kwargs


def render_conversation(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    kwargs: Mapping[str, Any],
    tools: list[dict[str, Any]] | None,
    param: str,
) -> str:
    """The conversation and the tools offered as the model's chat template writes them; a template that rejects
    them is a 400 on `param` (the request field the messages came in)."""
    try:
        return tokenizer.render_chat_template(messages, kwargs, tools=tools)
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), param) from exc
