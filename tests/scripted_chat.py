"""The scripted chat model that the reasoning and Responses API tests serve (tests/model_factory.py builds it).

A prompt's last token picks what the model writes: a message ending in a trigger gets that trigger's script,
greedily, then EOS. The chat template drops reasoning from past content as Qwen3's does (so the server's reasoning
parser is `auto`-detected as qwen3), writes tool calls in Hermes' `<tool_call>` form (so the tool-call parser is
`auto`-detected as hermes), and reads `enable_thinking` and `reasoning_effort`, whose values append triggers of
their own.
"""

from __future__ import annotations

REASON = "[reason]"
REASONING, ANSWER = "Ferries float.", "They carry people."
NO_THINK_ANSWER = "Straight answer."
EFFORT_ANSWER = "Thought hard."
LONG = "[long]"
LONG_PIECES = ["<think>\nPondering", " more", " and more", "</think>never reached"]
PLAIN = "[plain]"
PLAIN_PIECES = ["Just", " plain", " text."]
CALL = "[call]"
CALL_NAME, CALL_ARGUMENTS = "get_weather", {"city": "Paris"}
TOOL_RESULT = "[weather-result]"
"""End a tool's output with this: the model then answers from it."""
AFTER_TOOL_ANSWER = "It is sunny in Paris."
THINK_AND_CALL = "[think-call]"
THINK_AND_CALL_REASONING = "I should look it up."

SCRIPTS: dict[str, list[str]] = {
    REASON: ["<think>", f"\n{REASONING}\n", "</think>", "\n\n", ANSWER],
    "[no-think]": [NO_THINK_ANSWER],
    "[effort-high]": [EFFORT_ANSWER],
    LONG: LONG_PIECES,
    PLAIN: PLAIN_PIECES,
    CALL: ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"],
    TOOL_RESULT: [AFTER_TOOL_ANSWER],
    THINK_AND_CALL: [
        f"<think>\n{THINK_AND_CALL_REASONING}\n</think>\n\n",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    ],
}

# Hermes-style tool use, as Qwen's templates write it (so `--tool-call-parser auto` picks hermes).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ (m['content'] or '').split('</think>')[-1] }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
    "{% if reasoning_effort is defined %}[effort-{{ reasoning_effort }}]{% endif %}"
)
