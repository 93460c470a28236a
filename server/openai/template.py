"""What a request passes to the model's chat template beyond its messages: `chat_template_kwargs` and the reasoning
effort, each checked against the variables the template reads, so that nothing a client sets is silently unused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Literal

from server.openai.errors import invalid_request, unsupported_parameter

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
