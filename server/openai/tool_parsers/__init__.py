"""Tool-call readers: one module per model format (what `tool_choice: auto` parses), and the readers of calls the
grammar enforced (`required`, a named function). `--tool-call-parser auto` picks the format from the chat template.
"""

from __future__ import annotations

from server.openai.tool_parsers.base import ToolCallReader
from server.openai.tool_parsers.hermes import START as HERMES_START
from server.openai.tool_parsers.hermes import HermesToolParser
from server.openai.tool_parsers.kimi_k2 import SECTION_BEGIN as KIMI_K2_SECTION
from server.openai.tool_parsers.kimi_k2 import KimiK2ToolParser
from server.openai.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from server.openai.tool_parsers.mistral import MARKER as MISTRAL_MARKER
from server.openai.tool_parsers.mistral import MistralToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallReader]] = {
    "hermes": HermesToolParser,
    "kimi_k2": KimiK2ToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def detect_tool_call_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model for calls, by the markers it writes; None if it shows none."""
    if not chat_template:
        return None
    if HERMES_START in chat_template:
        return "hermes"
    if MISTRAL_MARKER in chat_template:
        return "mistral"
    if KIMI_K2_SECTION in chat_template:
        return "kimi_k2"
    # Llama 3.1+ templates put tool results under the `ipython` role and describe calls as JSON "parameters".
    if PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None
