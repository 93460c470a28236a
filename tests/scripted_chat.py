"""The scripted chat model that the reasoning and Responses API tests serve (tests/model_factory.py builds it).

A prompt's last token picks what the model writes: a user message ending in a trigger gets that trigger's script,
greedily, then EOS. The chat template drops past reasoning as Qwen3's does (so the server's reasoning parser is
`auto`-detected), and reads `enable_thinking` and `reasoning_effort`, whose values append triggers of their own.
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

SCRIPTS: dict[str, list[str]] = {
    REASON: ["<think>", f"\n{REASONING}\n", "</think>", "\n\n", ANSWER],
    "[no-think]": [NO_THINK_ANSWER],
    "[effort-high]": [EFFORT_ANSWER],
    LONG: LONG_PIECES,
    PLAIN: PLAIN_PIECES,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ (m['content'] or '').split('</think>')[-1] }}"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
    "{% if reasoning_effort is defined %}[effort-{{ reasoning_effort }}]{% endif %}"
)
