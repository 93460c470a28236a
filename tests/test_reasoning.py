"""The reasoning parser on scripted model output: what is reasoning, what is answer, however the text is chunked."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.core.request import FinishReason, StepOutput
from server.openai.choices import ChoiceState
from server.reasoning import ReasoningParser, ReasoningSplitter
from server.tokens import Tokenizer
from tests.model_factory import build_tokenizer

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
THINKING_PROMPT = QWEN3_PROMPT + "<think>\n"  # a thinking-only template opens the block itself
NO_THINKING_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking=False

# (parser, prompt, model output, expected reasoning, expected answer)
CASES = [
    ("qwen3", QWEN3_PROMPT, "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("qwen3", QWEN3_PROMPT, "  <think>a</think>b", "a", "b"),
    ("qwen3", QWEN3_PROMPT, "No reasoning here.", "", "No reasoning here."),
    ("qwen3", QWEN3_PROMPT, "\n\nLeading newlines stay", "", "\n\nLeading newlines stay"),
    ("qwen3", QWEN3_PROMPT, "Text then <think>not reasoning</think>", "", "Text then <think>not reasoning</think>"),
    ("qwen3", QWEN3_PROMPT, "<think>\ncut short by max_tokens\n\n", "cut short by max_tokens", ""),
    ("qwen3", QWEN3_PROMPT, "<thi", "", "<thi"),
    ("qwen3", THINKING_PROMPT, "Let me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("qwen3", NO_THINKING_PROMPT, "It is 4.", "", "It is 4."),
    ("qwen3", QWEN3_PROMPT, "<think>\n\n</think>\n\nEmpty thoughts", "", "Empty thoughts"),
    ("qwen3", QWEN3_PROMPT, "<think>a < b </thin k></think>x", "a < b </thin k>", "x"),
    ("qwen3", QWEN3_PROMPT, "<think>1\n\n2</think>", "1\n\n2", ""),
    ("deepseek_r1", QWEN3_PROMPT, "Hmm.\n</think>\n\nAnswer.", "Hmm.", "Answer."),
    ("deepseek_r1", QWEN3_PROMPT, "<think>\nHmm.</think>Answer.", "Hmm.", "Answer."),
    ("deepseek_r1", QWEN3_PROMPT, "Never closed", "Never closed", ""),
]


def parser(name: str) -> ReasoningParser:
    return ReasoningParser(name, starts_in_reasoning=name == "deepseek_r1")  # type: ignore[arg-type]


def split(splitter: ReasoningSplitter, chunks: list[str]) -> tuple[str, str]:
    reasoning = answer = ""
    for chunk in chunks:
        delta = splitter.feed(chunk)
        reasoning, answer = reasoning + delta.reasoning, answer + delta.content
    delta = splitter.flush()
    return reasoning + delta.reasoning, answer + delta.content


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "answer"), CASES)
def test_whole_text(name: str, prompt: str, output: str, reasoning: str, answer: str) -> None:
    assert split(parser(name).splitter(prompt), [output]) == (reasoning, answer)


@pytest.mark.parametrize(("name", "prompt", "output", "reasoning", "answer"), CASES)
def test_one_character_at_a_time(name: str, prompt: str, output: str, reasoning: str, answer: str) -> None:
    assert split(parser(name).splitter(prompt), list(output)) == (reasoning, answer)


@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8))
def test_any_chunking_splits_alike(case: tuple[str, str, str, str, str], cuts: list[int]) -> None:
    name, prompt, output, reasoning, answer = case
    bounds = sorted({min(c, len(output)) for c in cuts})
    chunks = [output[a:b] for a, b in zip([0, *bounds], [*bounds, len(output)], strict=True)]
    assert split(parser(name).splitter(prompt), chunks) == (reasoning, answer)


def test_no_tag_text_leaves_a_stream_at_once() -> None:
    splitter = parser("qwen3").splitter(THINKING_PROMPT)
    assert splitter.feed("Thinking, ").reasoning == "Thinking, "
    assert splitter.feed("still </th").reasoning == "still "  # "</th" may be the closing tag: held
    delta = splitter.feed("ink>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "Answer")
    assert splitter.feed(" goes on").content == " goes on"


def test_auto_picks_qwen3_for_a_template_that_knows_think_tags(tmp_path: Path) -> None:
    fast = build_tokenizer(tmp_path)
    assert ReasoningParser.for_model("auto", Tokenizer(fast)) is None, "a template without think tags: no parser"
    fast.chat_template = "{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}"
    chosen = ReasoningParser.for_model("auto", Tokenizer(fast))
    assert chosen is not None and chosen.name == "qwen3" and not chosen.starts_in_reasoning
    chosen = ReasoningParser.for_model("deepseek_r1", Tokenizer(fast))
    assert chosen is not None and chosen.starts_in_reasoning
    assert ReasoningParser.for_model("none", Tokenizer(fast)) is None


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_think_tags_that_are_special_tokens_are_kept_for_the_splitter(tmp_path: Path, chunk: int) -> None:
    """Kimi K2 Thinking's tags are special tokens, which a detokenizer drops: kept in the text the splitter reads,
    they split reasoning from the answer, and the answer holds neither."""
    fast = build_tokenizer(tmp_path)
    fast.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer = Tokenizer(fast)
    parser = ReasoningParser.for_model("qwen3", tokenizer)
    assert parser is not None
    tokens = tokenizer.encode("<think>Ferries float.</think>They carry people.", add_special_tokens=False)
    assert tokenizer.decode(tokens) == "Ferries float.They carry people.", "the tags are special tokens"
    choice = ChoiceState(0, tokenizer, prompt_ids=[], stop=[], reasoning_splitter=parser.splitter(QWEN3_PROMPT))
    updates = [
        choice.consume(StepOutput("r", tokens[i : i + chunk], FinishReason.STOP if i + chunk >= len(tokens) else None))
        for i in range(0, len(tokens), chunk)
    ]
    assert "".join(update.reasoning for update in updates) == "Ferries float."
    assert "".join(update.text for update in updates) == "They carry people."
