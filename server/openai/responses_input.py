"""A Responses API request's `instructions` and `input` items -> the messages the chat template renders.

The items are a conversation as the API spells it; templates know chat messages, so:
- `instructions` is a system message ahead of everything; a `developer` message is a system one.
- An assistant `message` and the `function_call` items after it are one assistant turn: its content, and its
  `tool_calls` with object arguments (as chat's do, server/openai/tools.py).
- A `function_call_output` is a `tool` message answering the call of that `call_id`, with the call's name.
- A `reasoning` item is the `reasoning_content` of the assistant turn that follows it (templates that show past
  reasoning read that field; the others leave it out, as they do for chat).
Item kinds and content parts the server cannot render (images, files, hosted tools' items, references to stored
items) are refused by name. An earlier response's output items are input items too: a stored chain
(`previous_response_id`) or conversation renders through here as if the client had sent it whole.

`stored_items` gives input items the shape they are stored and listed back in.
"""

from __future__ import annotations

import uuid
from typing import Any

from server.openai.errors import APIError, invalid_request, unsupported_parameter
from server.openai.images import IMAGE_PART, ImageRef
from server.openai.responses_schemas import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputItem,
    InputText,
    MessageItem,
    OutputTextPart,
    ReasoningInputItem,
    RefusalPart,
)
from server.openai.tools import template_tool_call

STORED_ITEM_TYPES = ("item_reference",)
ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
"""The ids OpenAI gives stored items, by type."""


def template_messages(
    instructions: str | None, items: str | list[InputItem], images: list[ImageRef] | None = None
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it. With `images`, a user message's `input_image` parts are
    collected there, in order, and its content becomes the list of text and image parts templates place images
    by; without, image parts are refused."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not items:
        raise invalid_request("'input' must not be empty.", "input")
    called: dict[str, str] = {}
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ReasoningInputItem):
            if item.encrypted_content is not None:
                raise unsupported_parameter(f"{where}.encrypted_content", "this server cannot read it.")
            parts = item.content if item.content is not None else item.summary
            reasoning = (reasoning or "") + "".join(part.text for part in parts)
            continue
        if reasoning is not None and not _is_assistant_turn(item):
            raise invalid_request(
                f"The 'reasoning' item before '{where}' must be followed by the assistant turn it belongs to.", where
            )
        if isinstance(item, FunctionCallItem):
            call = template_tool_call(item.call_id, item.name, item.arguments)
            _assistant_turn(messages).setdefault("tool_calls", []).append(call)
            called[item.call_id] = item.name
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise invalid_request(
                    f"'{where}.call_id' ({item.call_id!r}) answers no function_call earlier in the input.",
                    f"{where}.call_id",
                )
            output = item.output if isinstance(item.output, str) else _text(item.output, f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "name": called[item.call_id], "content": output}
            )
        elif isinstance(item, MessageItem):
            content = _content(item, f"{where}.content", images)
            if item.role == "assistant":
                messages.append({"role": "assistant", "content": content})
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        else:
            raise _unsupported_kind(item, where)
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    if reasoning is not None:
        raise invalid_request("A 'reasoning' item must be followed by the assistant turn it belongs to.", "input")
    return messages


def check_storable(items: list[InputItem], param: str, takes_images: bool) -> None:
    """Refuse (400, by name) items that could not be rendered when a response reads them back: the checks
    `template_messages` makes of each item on its own (images only where the model takes them)."""
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if isinstance(item, ReasoningInputItem) and item.encrypted_content is not None:
            raise unsupported_parameter(f"{where}.encrypted_content", "this server cannot read it.")
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            _content(item, f"{where}.content", [] if takes_images else None)
        elif isinstance(item, FunctionCallOutputItem) and not isinstance(item.output, str):
            _text(item.output, f"{where}.output")
        elif not isinstance(item, MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem):
            raise _unsupported_kind(item, where)


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as a response's input_items and a conversation's items hold them, as OpenAI lists them back: each with
    an id of its own (a client's is not kept: ids are unique among stored items), a status, and a message's text as
    one content part."""
    stored = []
    for item in items:
        fields = item.model_dump(mode="json", exclude_none=True, by_alias=True)
        kind = fields.get("type", "message")
        if kind == "message" and isinstance(fields["content"], str):
            part = "output_text" if fields["role"] == "assistant" else "input_text"
            fields["content"] = [{"type": part, "text": fields["content"]}]
        stored.append({**fields, "id": f"{ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}", "type": kind,
                       "status": fields.get("status", "completed")})  # fmt: skip
    return stored


def _unsupported_kind(item: InputItem, where: str) -> APIError:
    detail = "send the items themselves." if item.type in STORED_ITEM_TYPES else f"'{item.type}' items."
    return unsupported_parameter(f"{where}.type", detail)


def _is_assistant_turn(item: InputItem) -> bool:
    return isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant")


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that calls belong to: the last message if it is one, otherwise a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _content(item: MessageItem, where: str, images: list[ImageRef] | None) -> str | list[dict[str, Any]]:
    """A message's text, or (a user's, with images) its text and image parts."""
    parts = item.content
    if isinstance(parts, str):
        return parts
    if images is None or item.role != "user" or not any(isinstance(part, InputImage) for part in parts):
        return _text(parts, where)
    content: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, InputImage):
            if part.file_id is not None:
                raise unsupported_parameter(f"{where}[{j}].file_id", "send the image as image_url.")
            if part.image_url is None:
                raise invalid_request(f"Missing required parameter: '{where}[{j}].image_url'.",
                                      f"{where}[{j}].image_url", code="missing_required_parameter")  # fmt: skip
            images.append(ImageRef(part.image_url, f"{where}[{j}].image_url", part.detail))
            content.append(dict(IMAGE_PART))
        else:
            content.append({"type": "text", "text": _text([part], where)})
    return content


def _text(parts: list[ContentPart], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, InputText | OutputTextPart):
            texts.append(part.text)
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
        else:
            raise unsupported_parameter(f"{where}[{j}].type", f"'{part.type}' parts (only text is).")
    return "".join(texts)
