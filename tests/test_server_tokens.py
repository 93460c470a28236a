"""Unit tests of the front end's text handling: incremental detokenizer, stop strings, chat template."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tokens import REPLACEMENT_CHAR, ChatTemplateError, IncrementalDetokenizer, StopStringMatcher, Tokenizer
from tests.model_factory import build_tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld — 你好，世界 🙂 ferry boats",
    "🙂🙂🙂 emoji 👍🏽 with a skin tone and a flag 🇫🇷",
    "日本語のテキストと한국어 텍스트",
    "plain ascii text, nothing special",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_tokenizer(tmp_path_factory.mktemp("tokenizer")))


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detokenizer.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_detokenizer_streams_exactly_the_full_text(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tokenizer.detokenizer([]), ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas), "a split character leaked half-decoded"


def test_multibyte_characters_really_are_split_across_tokens(tokenizer: Tokenizer) -> None:
    """Guards the test above: the tiny tokenizer must cut some characters between tokens."""
    ids = tokenizer.encode("你好 🙂", add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token]) for token in ids)


def test_detokenizer_with_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("ferry boats carry", add_special_tokens=False)
    output = tokenizer.encode(" passengers 你好 🙂 across", add_special_tokens=False)
    assert "".join(stream(tokenizer.detokenizer(prompt), output)) == tokenizer.decode(output)


def test_incomplete_character_is_held_then_flushed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = next(i for i in range(len(ids), 0, -1) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    detokenizer = tokenizer.detokenizer([])
    assert "".join(detokenizer.push([token]) for token in ids[:cut]) == "ok "
    tail = detokenizer.flush()
    assert tail.endswith(REPLACEMENT_CHAR) and "ok " + tail == tokenizer.decode(ids[:cut])


def test_special_tokens_add_no_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.encode("<|eos|>", add_special_tokens=False)
    detokenizer = tokenizer.detokenizer([])
    assert detokenizer.push(tokenizer.encode("hi", add_special_tokens=False)) == "hi"
    assert detokenizer.push(eos) == ""
    assert detokenizer.flush() == ""


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_decoding_through_the_rust_tokenizer_is_transformers_decode(
    tokenizer: Tokenizer, data: st.DataObject, skip: bool
) -> None:
    """The fast path (the backend tokenizer's own decode) gives what transformers' `decode` gives, with the
    special tokens (ids 0-2) kept or skipped."""
    ids = data.draw(st.lists(st.integers(min_value=0, max_value=tokenizer.vocab_size - 1), max_size=12))
    assert tokenizer._backend is not None, "the tiny tokenizer must take the fast path for this test to mean anything"
    expected = tokenizer._tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tokenizer.decode(ids, skip_special_tokens=skip) == expected


def test_a_tokenizer_that_decodes_its_own_way_keeps_it(tmp_path: Path) -> None:
    """A tokenizer class that overrides `_decode` (Whisper, CodeGen and others do) is decoded through it."""
    base = build_tokenizer(tmp_path)

    class Shouting(type(base)):  # type: ignore[misc]
        def _decode(self, token_ids: list[int], **kwargs: object) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    shouting = Shouting.from_pretrained(str(tmp_path))
    tokenizer = Tokenizer(shouting)
    ids = tokenizer.encode("ferry boats", add_special_tokens=False)
    assert tokenizer._backend is None
    assert tokenizer.decode(ids) == "FERRY BOATS"
    assert "".join(stream(tokenizer.detokenizer([]), ids)) == "FERRY BOATS"


def feed_all(matcher: StopStringMatcher, parts: list[str]) -> tuple[str, bool]:
    out = []
    for part in parts:
        text, stopped = matcher.feed(part)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_string_split_across_deltas_is_cut_and_never_leaked() -> None:
    matcher = StopStringMatcher(["lo W"])
    assert matcher.feed("Hel") == ("He", False)  # "l" might start "lo W": held back
    assert matcher.feed("lo ") == ("l", False)
    assert matcher.feed("World") == ("", True)


def test_held_back_text_is_released_when_it_does_not_match() -> None:
    assert feed_all(StopStringMatcher(["STOP"]), ["abc S", "T", "x"]) == ("abc STx", False)
    assert feed_all(StopStringMatcher(["STOP"]), ["abc ST"]) == ("abc ST", False)


def test_first_completed_stop_string_wins() -> None:
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", True)
    # "c" completes before "aca" does, even though "aca" starts earlier.
    assert feed_all(StopStringMatcher(["aca", "c"]), ["aaca"]) == ("aa", True)
    assert feed_all(StopStringMatcher(["", "x"]), ["abc"]) == ("abc", False)
    assert feed_all(StopStringMatcher([]), ["abc"]) == ("abc", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc🙂", max_size=30),
    stops=st.lists(st.text(alphabet="abc🙂", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_strings_match_a_plain_search(text: str, stops: list[str], cuts: list[int]) -> None:
    """However the text is cut into deltas, the result is what a character-by-character generator would stop at."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert feed_all(StopStringMatcher(stops), parts) == stop_char_by_char(text, stops)


def stop_char_by_char(text: str, stops: list[str]) -> tuple[str, bool]:
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[max(0, end - len(s)) : end] == s]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_chat_template_renders_and_tokenizes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    # The template writes BOS itself: it must not be added a second time.
    assert ids == tokenizer.encode("<|bos|><|user|>hi<|eos|><|assistant|>", add_special_tokens=False)


def test_chat_template_runs_in_a_sandbox(tmp_path: Path) -> None:
    fast = build_tokenizer(tmp_path)
    fast.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        Tokenizer(fast).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    fast = build_tokenizer(tmp_path)
    fast.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(fast).apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_tool_call_formats_special_markers_stay_in_the_text_it_reads(tmp_path: Path) -> None:
    fast = build_tokenizer(tmp_path)
    fast.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer = Tokenizer(fast)
    ids = [*tokenizer.encode("ok ", add_special_tokens=False), fast.convert_tokens_to_ids("[TOOL_CALLS]"),
           *tokenizer.encode("[]", add_special_tokens=False), fast.eos_token_id]  # fmt: skip
    assert "".join(stream(tokenizer.detokenizer([]), ids)) == "ok []", "special tokens are dropped by default"
    kept = "".join(stream(tokenizer.detokenizer([], keep_tokens=["[TOOL_CALLS]", "<tool_call>"]), ids))
    assert kept == "ok [TOOL_CALLS][]", "the marker is kept, the other special tokens (EOS) still dropped"


def test_tools_reach_the_chat_template(tmp_path: Path) -> None:
    fast = build_tokenizer(tmp_path)
    fast.chat_template = "{% for tool in tools %}{{ tool.function.name }};{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    ids = Tokenizer(fast).apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert Tokenizer(fast).decode(ids) == "get_time;hi"
