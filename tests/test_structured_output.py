"""Constrained decoding in the engine: what a random-weight model generates under a JSON schema, a regex, a choice
or a grammar satisfies it within max_tokens; constrained rows leave their neighbours' greedy output alone; the
grammar state survives chunked prefill and preemption; grammars compile once, off the loop; bad constraints are
refused with the library's reason."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine import (
    ContinuousBatchingManager,
    EngineConfig,
    EngineCore,
    FinishReason,
    RequestRejected,
    SamplingParams,
    StructuredOutput,
    generate_batch,
)
from engine.core.observer import StepRecord
from engine.core.structured import CompiledGrammar, GrammarCompiler, check

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
            },
            "required": ["city"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "nickname": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "role", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 5},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "tags": {"type": "array", "items": {"enum": ["new", "gift", "rush"]}, "maxItems": 2},
        "express": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    "required": ["items", "express"],
}
TEXTS = ["The json module", "hello world", "ferry boats carry", "A list is", "What is a list?", "x", "Return it"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama)


def _engine(model: Path, **overrides) -> EngineCore:
    return EngineCore(EngineConfig.of(model=str(model), debug_checks=True, **{"num_pages": 256, **overrides}))


def _prompts(tokenizer: PreTrainedTokenizerBase, count: int) -> list[list[int]]:
    return [tokenizer.encode(TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS))) for i in range(count)]


def _constrained(kind: str, spec: str = "", **params) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutput(kind, spec), **{"max_new_tokens": 200, **params})


def _texts(tokenizer: PreTrainedTokenizerBase, outputs) -> list[str]:
    """Each output decoded without its final EOS, after checking it ended on it (STOP, not out of tokens)."""
    texts = []
    for output in outputs.values():
        assert output.finish_reason is FinishReason.STOP, tokenizer.decode(output.generated_ids)
        assert output.generated_ids[-1] == tokenizer.eos_token_id
        texts.append(tokenizer.decode(output.generated_ids[:-1]))
    return texts


@pytest.mark.parametrize("schema", [PROFILE, ORDER], ids=["profile", "order"])
def test_json_schema_outputs_validate(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase, schema: dict) -> None:
    prompts = _prompts(tokenizer, 6)
    params = [_constrained("json_schema", json.dumps(schema), seed=i, temperature=i % 2) for i in range(6)]
    outputs = generate_batch(prompts, params=params, engine=_engine(tiny_llama))
    for text in _texts(tokenizer, outputs):
        value = json.loads(text)
        jsonschema.validate(value, schema)
        # Objects listing their properties are closed: no key the schema does not name.
        assert set(value) <= set(schema["properties"])


def test_json_object_outputs_are_objects(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    # Any JSON object is unbounded (a key may run on): these prompts are ones the tiny model closes.
    prompts = [tokenizer.encode(text) for text in ["The json module", "A list is", "x", "What is a list?"]]
    outputs = generate_batch(prompts, params=_constrained("json_object", max_new_tokens=64), engine=_engine(tiny_llama))
    for text in _texts(tokenizer, outputs):
        assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    choices = ["yes", "no", 'say "maybe"', "ünï 🙂"]
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/'
    cases = [
        (_constrained("regex", r"[a-z]{2,5}-[0-9]{3}"), lambda text: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text)),
        (_constrained("choice", json.dumps(choices)), lambda text: text in choices),
        (_constrained("grammar", lark), lambda text: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text)),
    ]
    prompts = _prompts(tokenizer, 4)
    for params, valid in cases:
        sampled = [params, params, dataclasses.replace(params, temperature=1.0, seed=3), params]
        outputs = generate_batch(prompts, params=sampled, engine=_engine(tiny_llama))
        for text in _texts(tokenizer, outputs):
            assert valid(text), text


def test_json_has_no_free_whitespace(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Whitespace only as the separators ", " and ": ": a small model cannot pad its way to max_tokens."""
    compiled = GrammarCompiler(str(tiny_llama)).compile(StructuredOutput("json_schema", json.dumps(ORDER)))

    def accepts(text: str) -> bool:
        matcher = compiled.matcher()
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts('{"items": [{"sku": "a b", "qty": 2}], "express": true}')
    for padded in ['{ "items"', '{"items":  [', '{"items": [{"sku": "a", "qty": 2}],\n', '{"items" : [']:
        assert not accepts(padded), padded


def test_constrained_row_leaves_the_rest_of_the_batch_unchanged(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(10, len(tokenizer)) for _ in range(rng.randrange(3, 40))] for _ in range(32)]
    free = [SamplingParams(max_new_tokens=rng.randrange(4, 20)) for _ in range(31)]
    alone = generate_batch(prompts[:31], params=free, engine=_engine(tiny_llama))
    together = generate_batch(
        prompts, params=[*free, _constrained("json_schema", json.dumps(PROFILE))], engine=_engine(tiny_llama)
    )
    for i in range(31):
        assert together[f"req_{i}"].generated_ids == alone[f"req_{i}"].generated_ids, i
    jsonschema.validate(json.loads(_texts(tokenizer, {"last": together["req_31"]})[0]), PROFILE)


class _Preemptions:
    """Ids of requests preempted, and of those resumed with tokens already generated (the matcher replays them)."""

    def __init__(self) -> None:
        self.preempted: set[str] = set()
        self.resumed_with_output: set[str] = set()

    def on_step(self, record: StepRecord) -> None:
        self.preempted.update(record.plan.preempted_ids)
        self.resumed_with_output.update(new.request_id for new in record.plan.new_requests if new.output_ids)


def test_constrained_output_survives_chunked_prefill_and_preemption(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(10, len(tokenizer)) for _ in range(rng.randrange(10, 30))] for _ in range(8)]
    params = [
        _constrained("json_schema", json.dumps(PROFILE if i % 2 else ORDER), max_new_tokens=120)
        if i % 4 != 3
        else SamplingParams(max_new_tokens=40)
        for i in range(8)
    ]

    def run(observer: _Preemptions | None = None, **config) -> dict[str, list[int]]:
        engine = EngineCore(
            EngineConfig.of(model=str(tiny_llama), debug_checks=True, **config),
            observers=[observer] if observer else [],
        )
        return {rid: out.generated_ids for rid, out in generate_batch(prompts, params=params, engine=engine).items()}

    roomy = run(num_pages=512, max_batch_tokens=2048)
    assert run(num_pages=512, max_batch_tokens=16) == roomy
    preemptions = _Preemptions()
    assert run(preemptions, num_pages=40, page_size=4, max_batch_tokens=256) == roomy
    constrained_ids = {f"req_{i}" for i in range(8) if params[i].structured_output is not None}
    assert preemptions.resumed_with_output & constrained_ids, "no constrained request resumed mid-answer"


def test_same_constraint_compiles_once(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    engine = _engine(tiny_llama)
    # n > 1 is several engine requests with the same constraint: one compile between them.
    params = [_constrained("choice", '["a", "b"]')] * 3 + [_constrained("regex", "[0-9]{2}")]
    generate_batch(_prompts(tokenizer, 4), params=params, engine=engine)
    info = engine.grammars.cache_info()
    assert (info.misses, info.size) == (2, 2)
    generate_batch(_prompts(tokenizer, 1), params=params[:1], engine=engine)
    assert engine.grammars.cache_info().misses == 2


def test_cache_evicts_least_recently_used(tiny_llama: Path) -> None:
    compiler = GrammarCompiler(str(tiny_llama), cache_size=2)
    a, b, c = (StructuredOutput("regex", spec) for spec in ("a+", "b+", "c+"))
    for so in (a, b, a, c, a):
        compiler.compile(so)
    assert compiler.cache_info()[:3] == (2, 3, 2)  # b was evicted, a stayed: a was used last
    compiler.compile(b)
    assert compiler.cache_info().misses == 4


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum (5) is greater than maximum"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "/$defs/missing"),
        ("regex", "[a-", "unclosed character class"),
        ("grammar", "start: nowhere", 'unknown name: "nowhere"'),
    ],
)
def test_invalid_constraint_is_rejected_with_the_reason(
    tiny_llama: Path, tokenizer: PreTrainedTokenizerBase, kind: str, spec: str, reason: str
) -> None:
    structured_output = StructuredOutput(kind, spec)
    with pytest.raises(RequestRejected, match=re.escape(reason)) as checked:
        check(structured_output, str(tiny_llama))
    assert checked.value.code == "invalid_structured_output"
    engine = _engine(tiny_llama)
    for _ in range(2):  # the second time from the cache, with the same answer
        with pytest.raises(RequestRejected, match=re.escape(reason)) as rejected:
            generate_batch(_prompts(tokenizer, 1), params=_constrained(kind, spec), engine=engine)
        assert rejected.value.code == "invalid_structured_output"
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize(
    ("kind", "spec", "params", "reason"),
    [
        ("json_schema", "", {}, "needs a non-empty spec"),
        ("json_schema", "[1]", {}, "must be a JSON object"),
        ("json_schema", "{nope", {}, "not valid JSON"),
        ("choice", "[]", {}, "non-empty JSON array"),
        ("choice", '"a"', {}, "non-empty JSON array"),
        ("json_object", "{}", {}, "takes no spec"),
        ("regex", "a", {"ignore_eos": True}, "ignore_eos"),
        ("regex", "a", {"min_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_malformed_constraint_is_refused_up_front(kind: str, spec: str, params: dict, reason: str) -> None:
    with pytest.raises(RequestRejected, match=reason):
        SamplingParams(structured_output=StructuredOutput(kind, spec), **params)


def test_request_that_cannot_end_is_refused(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(RequestRejected, match="needs a token to end with"):
        generate_batch(
            _prompts(tokenizer, 1), params=_constrained("regex", "a", eos_token_ids=()), engine=_engine(tiny_llama)
        )


def test_own_end_tokens_replace_eos(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """A request with its own EOS or stop ids may end only on those once its grammar is complete."""
    end = tokenizer.convert_tokens_to_ids("<|user|>")
    params = [
        _constrained("choice", '["yes", "no"]', eos_token_ids=(end,)),
        _constrained("choice", '["yes", "no"]', stop_token_ids=(end,)),
    ]
    outputs = generate_batch(_prompts(tokenizer, 2), params=params, engine=_engine(tiny_llama))
    ends = [(out.finish_reason, out.generated_ids[-1]) for out in outputs.values()]
    assert ends[0] == (FinishReason.STOP, end)
    assert ends[1][0] is FinishReason.STOP and ends[1][1] in (end, tokenizer.eos_token_id)
    for out in outputs.values():
        assert tokenizer.decode(out.generated_ids[:-1]) in ("yes", "no")


def test_logprobs_are_of_the_allowed_tokens(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Logprobs come from the masked distribution: alternatives are tokens the grammar allowed, renormalised."""
    choices = ["yes", "no", "never"]
    params = _constrained("choice", json.dumps(choices), logprobs=True, top_logprobs=20)
    output = generate_batch(_prompts(tokenizer, 1), params=params, engine=_engine(tiny_llama))["req_0"]
    compiled = GrammarCompiler(str(tiny_llama)).compile(params.structured_output)
    for position, logprob in enumerate(output.logprobs):
        allowed = _allowed(compiled, output.generated_ids[:position], [token for token, _ in logprob.top])
        finite = [(token, value) for token, value in logprob.top if value > -math.inf]
        assert {token for token, _ in finite} <= allowed
        assert logprob.token_id in allowed
        # Fewer allowed tokens than alternatives asked for: all of them are listed, and they hold all the mass.
        assert math.isclose(sum(math.exp(value) for _, value in finite), 1.0, rel_tol=1e-4)


def _allowed(compiled: CompiledGrammar, prefix: list[int], candidates: list[int]) -> set[int]:
    matcher = compiled.matcher()
    assert matcher.consume_tokens(prefix)
    allowed = set()
    for token in candidates:
        probe = matcher.deep_copy()
        if probe.consume_token(token):
            allowed.add(token)
    return allowed


def test_unconstrained_steps_never_touch_the_grammar_path(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    engine = _engine(tiny_llama)
    generate_batch(_prompts(tokenizer, 4), params=SamplingParams(max_new_tokens=8), engine=engine)
    assert engine.runner.step_grammars.masker is None
    assert engine.grammars.cache_info().misses == 0

    class ConstrainedRows:
        rows = 0

        def on_step(self, record: StepRecord) -> None:
            sampling = [
                rid for rid, samples in zip(record.plan.request_ids, record.plan.samples, strict=True) if samples
            ]
            self.rows += sum(rid == "req_0" for rid in sampling)

    counter = ConstrainedRows()
    engine.observers.append(counter)
    params = [_constrained("regex", "[a-z]{3,6}"), *[SamplingParams(max_new_tokens=30)] * 3]
    generate_batch(_prompts(tokenizer, 4), params=params, engine=engine)
    # Exactly the constrained request's sampling rows were masked, none of its neighbours'.
    assert engine.runner.step_grammars.masker.num_masked_rows == counter.rows > 0


class _GatedCompiler(GrammarCompiler):
    """Compiles only once the test opens the gate: a slow schema, on demand."""

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(tokenizer_dir)
        self.gate = threading.Event()

    def _compile(self, structured_output: StructuredOutput) -> CompiledGrammar:
        assert self.gate.wait(30)
        return super()._compile(structured_output)


def test_slow_compile_stalls_nobody(tiny_llama: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    compiler = _GatedCompiler(str(tiny_llama))
    config = EngineConfig.of(model=str(tiny_llama), num_pages=256, debug_checks=True)
    engine = EngineCore(config, grammars=compiler)
    prompt = _prompts(tokenizer, 1)[0]
    with ContinuousBatchingManager(engine) as manager:
        slow = manager.add_request(prompt, _constrained("regex", "[a-z]{3}"))
        doomed = manager.add_request(prompt, _constrained("regex", "[0-9]{3}"))
        invalid = manager.add_request(prompt, _constrained("json_schema", '{"not": {}}'))
        free = manager.add_request(prompt, SamplingParams(max_new_tokens=12))
        assert manager.get_result(free, timeout=30).finish_reason is FinishReason.LENGTH
        assert engine.stats().num_waiting == 3  # still compiling, and counted as waiting
        manager.cancel_request(doomed)
        assert manager.get_result(doomed, timeout=30).finish_reason is FinishReason.ABORT
        compiler.gate.set()
        result = manager.get_result(slow, timeout=30)
        assert result.finish_reason is FinishReason.STOP
        assert re.fullmatch("[a-z]{3}", tokenizer.decode(result.generated_ids[:-1]))
        refused = manager.get_result(invalid, timeout=30)
        assert refused.finish_reason is FinishReason.ABORT
        assert 'Unimplemented keys: ["not"]' in refused.error
    assert engine.is_idle_and_clean()
