"""JSON that closes within its token budget (engine/sampling/json_closing.py, token_masks.BudgetClosing).

The tracker and its shortest completions are checked against the grammar library itself: random schemas, random
walks through what the grammar allows (the demo tokenizer's tokens, split characters included), and at every
step the completion must be text the grammar accepts as complete and that validates. Then through the engine, a
random-weight model at temperature 1 under random schemas and small token limits: every answer parses and
validates, or the shortest valid answer is longer than the limit; `length` whenever the budget closed it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine import EngineConfig, EngineCore, FinishReason, SamplingParams, StructuredOutput, generate_batch
from engine.core.structured import JSON_OPTIONS, GrammarCompiler, _close_objects
from engine.sampling.json_closing import AnswerProgress, JsonProgress

DEMO_MODEL = Path(__file__).resolve().parents[1] / "server" / "default_model"
CALLS = {  # a `required` tool choice's schema, as server/openai/tools.py builds it
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["get_weather"]},
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "parameters"],
            },
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["add"]},
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"],
                    },
                },
                "required": ["name", "parameters"],
            },
        ]
    },
}


# ------------------------------------------------------------------------------------------------ the tracker


@pytest.mark.parametrize(
    ("schema", "text", "completion"),
    [
        ({"type": "object"}, "", "{}"),
        ({"type": "object"}, '{"ke', '": 0}'),
        ({"type": "object"}, '{"a": [1, {"b": "x\\', 'n"}]}'),
        ({"type": "object"}, '{"a": "\\u00', '00"}'),
        ({"type": "object"}, '{"a": 12.', "0}"),
        ({"type": "object"}, '{"a": tr', "ue}"),
        ({"type": "object"}, '{"a": 1,', ' "": 0}'),
        (
            {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["y"]},
            '{"x": 5',
            ', "y": ""}',
        ),
        ({"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2}, '["a', 'a", "aa"]'),
        ({"enum": ["alpha", "beta", 7]}, '"b', 'eta"'),
        ({"type": "integer", "minimum": 12}, "", "12"),
        (CALLS, '[{"name": "a', 'dd", "parameters": {"a": 0, "b": 0}}]'),
        (CALLS, '[{"name": "get_weather", "parameters": {"city": "Par', '"}}]'),
        ({"type": "string", "pattern": "^[a-z]+$"}, '"ab', None),
    ],
)
def test_shortest_completion(schema: dict, text: str, completion: str | None) -> None:
    assert JsonProgress.of(_close_objects(schema)).feed(text).shortest_completion() == completion


def test_complete_value_needs_nothing_more() -> None:
    assert JsonProgress.of({"type": "object"}).feed('{"a": [1]}').shortest_completion() == ""


# ------------------------------------------------------------------------------------------------ random schemas

_NAMES = st.sampled_from(["a", "b", "id", "name", "tags", "kind", "x1", "value", "é"])
_SCALARS = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", **({} if lo is None else {"minimum": lo, "maximum": lo + span})},
        st.none() | st.integers(-50, 50),
        st.integers(0, 1000),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 12),
    ),
    st.just({"type": "string"}),
    st.lists(
        st.one_of(st.text("abcé ", min_size=1, max_size=6), st.integers(-5, 99)), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
)


def _object(properties: dict[str, dict], required: list[bool]) -> dict:
    names = list(properties)
    return {
        "type": "object",
        "properties": properties,
        "required": [n for n, r in zip(names, required, strict=False) if r],
    }


_SCHEMAS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.builds(
            _object,
            st.dictionaries(_NAMES, inner, min_size=1, max_size=4),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        st.builds(
            lambda items, lo: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + 3},
            inner,
            st.integers(0, 2),
        ),
        st.lists(inner, min_size=2, max_size=3).map(lambda branches: {"anyOf": branches}),
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def demo_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def ll_tokenizer(demo_tokenizer: PreTrainedTokenizerBase) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(demo_tokenizer)


def _matcher(tokenizer: llguidance.LLTokenizer, schema: dict) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _allowed(matcher: llguidance.LLMatcher, vocab: int, eos: int) -> list[int]:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return [int(t) for t in np.nonzero(np.unpackbits(bits, bitorder="little"))[0] if t < vocab and t != eos]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, seed=st.integers(0, 2**32 - 1))
def test_every_completion_closes_and_validates(schema: dict, seed: int, ll_tokenizer: llguidance.LLTokenizer) -> None:
    """A random walk through what the grammar allows; after every token the completion the tracker proposes is
    accepted by the grammar as complete, and the whole text validates against the schema."""
    closed = _close_objects(schema)
    _walk(
        _matcher(ll_tokenizer, closed),
        JsonProgress.of(closed),
        ll_tokenizer,
        random.Random(seed),
        lambda text: jsonschema.validate(json.loads(text), schema),
    )


def _walk(
    matcher: llguidance.LLMatcher,
    progress: JsonProgress | AnswerProgress,
    tokenizer: llguidance.LLTokenizer,
    rng: random.Random,
    validate: Callable[[str], None],
) -> None:
    """Up to 40 random tokens the grammar allows; after each, the tracker's completion must be accepted by the
    grammar as complete, and the text with it must `validate`."""
    text, pending = "", b""
    for _ in range(rng.randint(0, 40)):
        allowed = _allowed(matcher, tokenizer.vocab_size, tokenizer.eos_token)
        if not allowed:
            break
        token = rng.choice(allowed)
        assert matcher.consume_token(token)
        pending += tokenizer.decode_bytes([token])
        try:
            piece, pending = pending.decode(), b""
        except UnicodeDecodeError:
            continue  # the tracker reads whole characters (BudgetClosing completes a split one first)
        text += piece
        progress = progress.feed(piece)
        completion = progress.shortest_completion()
        assert completion is not None, f"no completion after {text!r}"
        trial = matcher.deep_copy()
        tokens = tokenizer.tokenize_str(completion)
        assert all(trial.consume_token(t) for t in tokens) and trial.is_accepting(), (
            text,
            completion,
            json.dumps(getattr(progress, "schemas", None) and progress.schemas.root),
        )
        validate(text + completion)


TAGS = ("<tool_call>\n", "\n</tool_call>")


def _tool_calls_spec(arguments: dict, answer: dict | None, parallel: bool, text: bool = False) -> str:
    call = {
        "anyOf": [
            {"type": "object", "properties": {"name": {"enum": [name]}, "arguments": schema},
             "required": ["name", "arguments"]}
            for name, schema in (("lookup", arguments), ("noop", {"type": "object", "properties": {}}))
        ]
    }  # fmt: skip
    spec = {"begin": TAGS[0], "end": TAGS[1], "call": call, "parallel": parallel, "answer": answer, "text": text}
    return json.dumps(spec)


def _calls_or_answer(text: str, spec: dict) -> None:
    """Validate a complete tool_calls answer: its calls (tags stripped), its JSON answer, or free text."""
    if not text.startswith(TAGS[0]):
        if not spec["text"]:
            jsonschema.validate(json.loads(text), spec["answer"])
        return
    for block in text.removeprefix(TAGS[0]).removesuffix(TAGS[1]).split(TAGS[1] + TAGS[0]):
        jsonschema.validate(json.loads(block), spec["call"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arguments=_SCHEMAS.filter(lambda s: s.get("type") == "object"),
    answer=st.none() | _SCHEMAS,
    parallel=st.booleans(),
    text=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_tagged_calls_close_too(
    arguments: dict, answer: dict | None, parallel: bool, text: bool, seed: int, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    """The same walk through a `tool_calls` grammar (calls in the model's own format, or a JSON answer, or free
    text that does not start a call)."""
    spec = _tool_calls_spec(arguments, None if text else answer, parallel, text)
    compiled = GrammarCompiler(str(DEMO_MODEL)).compile(StructuredOutput("tool_calls", spec))
    progress = AnswerProgress.of(compiled.answer_schema, compiled.tagged_calls)
    _walk(
        compiled.matcher(),
        progress,
        ll_tokenizer,
        random.Random(seed),
        lambda text: _calls_or_answer(text, json.loads(spec)),
    )


# ------------------------------------------------------------------------------------------------ in the engine


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig.of(model=str(tiny_llama), debug_checks=True, num_pages=256))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama)


def _shortest_answer_tokens(tokenizer: PreTrainedTokenizerBase, schema: dict) -> int:
    return len(
        tokenizer.encode(JsonProgress.of(_close_objects(schema)).shortest_completion(), add_special_tokens=False)
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS, budget=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_constrained_answers_close_within_max_tokens(
    schema: dict, budget: int, seed: int, engine: EngineCore, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Random schemas, small limits, sampled at temperature 1: each answer is JSON that validates, or the
    shortest valid answer does not fit the limit; `stop` only where the model closed the value itself."""
    prompts = [tokenizer.encode(text) for text in ("The json module", "x", "A list is", "What is")]
    spec = StructuredOutput("json_schema", json.dumps(schema))
    params = [
        SamplingParams(max_new_tokens=budget, temperature=1.0, seed=seed + i, structured_output=spec)
        for i in range(len(prompts))
    ]
    outputs = generate_batch(prompts, params=params, engine=engine)
    fits = _shortest_answer_tokens(tokenizer, schema) <= budget
    for output in outputs.values():
        text = _answer(tokenizer, output.generated_ids)
        if fits:
            assert parses(text), (schema, budget, text, output.finish_reason)
            jsonschema.validate(json.loads(text), schema)


def test_budget_closing_says_length_and_can_be_turned_off(
    engine: EngineCore, tokenizer: PreTrainedTokenizerBase
) -> None:
    """An open JSON object at temperature 1 runs on; with 12 tokens it is closed, with `length`, and without
    closing it ends unclosed (the old behaviour, on request)."""
    prompts = [tokenizer.encode("The json module")] * 8
    spec = StructuredOutput("json_object")
    closed = generate_batch(
        prompts,
        params=[SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, structured_output=spec) for i in range(8)],
        engine=engine,
    )
    for output in closed.values():
        text = tokenizer.decode(
            output.generated_ids[:-1] if output.finish_reason is FinishReason.STOP else output.generated_ids
        )
        assert isinstance(json.loads(text), dict)
    assert any(output.finish_reason is FinishReason.LENGTH for output in closed.values())
    unclosed = generate_batch(
        prompts,
        params=[
            SamplingParams(
                max_new_tokens=12, temperature=1.0, seed=i, structured_output=spec, close_within_budget=False
            )
            for i in range(8)
        ],
        engine=engine,
    )
    texts = [tokenizer.decode(o.generated_ids) for o in unclosed.values() if o.finish_reason is FinishReason.LENGTH]
    assert any(not parses(text) for text in texts)


def _answer(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of an answer without the EOS it may end with (a closed value ends with EOS when it fits)."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_tagged_calls_close_within_max_tokens(engine: EngineCore, tokenizer: PreTrainedTokenizerBase) -> None:
    """Calls in the model's own format close within the limit too: each one parses and validates."""
    arguments = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                 "required": ["city", "days"]}  # fmt: skip
    spec = _tool_calls_spec(arguments, None, True)
    structured = StructuredOutput("tool_calls", spec)
    budget = _shortest_answer_tokens(tokenizer, {}) + len(tokenizer.encode(TAGS[0] + TAGS[1])) + 30
    params = [
        SamplingParams(max_new_tokens=budget, temperature=1.0, seed=i, structured_output=structured) for i in range(8)
    ]
    outputs = generate_batch([tokenizer.encode("x")] * 8, params=params, engine=engine)
    for output in outputs.values():
        _calls_or_answer(_answer(tokenizer, output.generated_ids), json.loads(spec))
