"""Structured output: a `StructuredOutput` compiled into a grammar that masks, token by token, what a request
may generate.

The grammar library is llguidance (chosen over xgrammar by measurement, BENCHMARKS.md "Structured output"): it
refuses the JSON-Schema keywords it cannot enforce (`uniqueItems`, `contains`, `not`, ...) with a message, where
xgrammar compiles some of them and then serves output that breaks the schema. `grammar` specs are llguidance's Lark
dialect (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md); `regex` specs are Rust-regex syntax.

JSON is compiled without free whitespace (`", "` and `": "` separate items and keys, nothing else), and an object
schema that lists `properties` without saying `additionalProperties` gets `false`, as in OpenAI's strict mode: the
output is still valid for the schema as written, and a small model cannot wander off into keys nobody asked for.

Compiling needs the model's vocabulary: the tokenizer loads from the model directory on first use. Grammars are
cached by (kind, spec), least recently used evicted, failures too, so the same schema compiles once; `submit`
compiles on a small thread pool, so the engine loop never waits for a slow schema.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import llguidance

from engine.core.request import RequestRejected, StructuredOutput
from engine.sampling.json_closing import TaggedCalls

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: no whitespace beyond the one space after each separator."""

_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose values are JSON data, not subschemas: an object there must stay exactly as written."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A constraint ready to enforce: each sequence starts from a copy of one fresh matcher."""

    structured_output: StructuredOutput
    template: llguidance.LLMatcher
    """Never advanced itself: copying it costs about a microsecond, building a matcher from the grammar a
    millisecond."""
    tokenizer: llguidance.LLTokenizer
    answer_schema: Any = None
    """The JSON Schema a JSON answer follows, as compiled (objects closed): a `json_schema` or `json_object`
    constraint's, or a `tool_calls` one's `answer`. With `tagged_calls`, what lets an answer close within its
    token budget (engine/sampling/token_masks.py BudgetClosing); both None for regex, choice, grammar and harmony
    (a gpt-oss reply's JSON comes after its reasoning: one cut short by its budget stays cut)."""
    tagged_calls: TaggedCalls | None = None
    """A `tool_calls` constraint's calls."""

    @property
    def closable(self) -> bool:
        return self.answer_schema is not None or self.tagged_calls is not None

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class GrammarCacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    max_size: int


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one model's tokenizer, cached; thread-safe.

    `vocab_size` is the model's (its logits may be wider than the tokenizer); `eos_token_ids` are the tokens a
    matcher allows once its grammar is complete (default: the tokenizer's EOS).
    """

    def __init__(
        self,
        tokenizer_dir: str,
        *,
        vocab_size: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_size: int = 512,
        max_workers: int = 2,
    ) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._hits = 0
        self._misses = 0
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it, loaded on first use (0.1-0.5 s: call it off the engine loop)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = _load_tokenizer(self.tokenizer_dir, self._vocab_size, self._eos_token_ids)
            return self._tokenizer

    def submit(self, structured_output: StructuredOutput) -> Future[CompiledGrammar]:
        """The compiled grammar, or a future one compiling in the background; it fails with RequestRejected."""
        future, compile_it = self._lookup(structured_output)
        if compile_it:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="ferry-grammar")
                pool = self._pool
            pool.submit(self._fill, future, structured_output)
        return future

    def compile(self, structured_output: StructuredOutput) -> CompiledGrammar:
        """Compile in the calling thread unless cached (or compiling elsewhere: then wait for it)."""
        future, compile_it = self._lookup(structured_output)
        if compile_it:
            self._fill(future, structured_output)
        return future.result()

    def cache_info(self) -> GrammarCacheInfo:
        with self._lock:
            return GrammarCacheInfo(self._hits, self._misses, len(self._cache), self._cache_size)

    def _lookup(self, structured_output: StructuredOutput) -> tuple[Future[CompiledGrammar], bool]:
        """The cache entry for this constraint, and whether the caller must compile it (a miss)."""
        key = (structured_output.kind, structured_output.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._hits += 1
                self._cache.move_to_end(key)
                return future, False
            self._misses += 1
            future = self._cache[key] = Future()
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future, True

    def _fill(self, future: Future[CompiledGrammar], structured_output: StructuredOutput) -> None:
        try:
            future.set_result(self._compile(structured_output))
        except RequestRejected as exc:
            future.set_exception(exc)
        except Exception as exc:
            # A tokenizer that does not load, say: the request still gets an answer instead of hanging.
            future.set_exception(
                RequestRejected(
                    f"structured output is unavailable for this model: {type(exc).__name__}: {exc}",
                    code="invalid_structured_output",
                )
            )

    def _compile(self, structured_output: StructuredOutput) -> CompiledGrammar:
        schema, calls = _json_shape(structured_output)
        if calls is not None:
            grammar = _tool_calls_grammar(calls, schema)
        elif structured_output.kind == "harmony":
            grammar = _harmony_grammar(json.loads(structured_output.spec))
        elif schema is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        else:
            grammar = _grammar(structured_output)
        # Building the matcher is what checks the grammar (it never raises: errors are its state).
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestRejected(
                f"unsupported or invalid {structured_output.kind}: {matcher.get_error()}",
                code="invalid_structured_output",
            )
        return CompiledGrammar(structured_output, matcher, self.tokenizer, schema, calls)


def check(structured_output: StructuredOutput, tokenizer_dir: str) -> None:
    """Compile `structured_output` for the tokenizer in `tokenizer_dir` (cached per directory), so that the front end
    answers a constraint the engine would refuse with a 400 before anything streams.

    Raises `RequestRejected` (code `invalid_structured_output`) with the library's message. Blocking: the first call
    per directory loads the tokenizer, a new spec compiles in about a millisecond, a cached one costs a dict lookup;
    async code calls it through `asyncio.to_thread`.
    """
    _compiler_for(tokenizer_dir).compile(structured_output)


@functools.lru_cache(maxsize=8)
def _compiler_for(tokenizer_dir: str) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_dir)


def _load_tokenizer(directory: str, vocab_size: int | None, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    # Heavy (llguidance.hf imports transformers), and needed only once a constrained request arrives.
    import llguidance.hf

    from engine.models.tokenizer import auto_tokenizer

    tokenizer = auto_tokenizer(directory)
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)


def _json_shape(structured_output: StructuredOutput) -> tuple[Any, TaggedCalls | None]:
    """The JSON answer's schema (objects closed) and the tagged calls a constraint allows; (None, None) for a
    regex, choice, grammar or harmony constraint."""
    kind = structured_output.kind
    if kind == "json_schema":
        return _close_objects(json.loads(structured_output.spec)), None
    if kind == "json_object":
        return {"type": "object"}, None
    if kind == "tool_calls":
        spec = json.loads(structured_output.spec)
        calls = TaggedCalls(spec["begin"], _close_objects(spec["call"]), spec["end"], spec["parallel"], spec["text"])
        return (None if spec["answer"] is None else _close_objects(spec["answer"])), calls
    return None, None


def _tool_calls_grammar(calls: TaggedCalls, answer: Any) -> str:
    """Lark for tagged calls (one, or one or more), or a JSON answer where one is allowed. `%json` takes the
    schema with the same JSON options as a plain JSON constraint; Lark string literals take JSON's escapes."""
    lines = [
        "start: calls" + (" | answer" if answer is not None else "") + (" | TEXT" if calls.text else ""),
        "calls: call+" if calls.repeat else "calls: call",
        f"call: {json.dumps(calls.begin)} {_embedded(calls.schema)} {json.dumps(calls.end)}",
    ]
    if answer is not None:
        lines.append(f"answer: {_embedded(answer)}")
    if calls.text:
        lines.append(f"TEXT: /{_not_starting_with(calls.begin)}/")
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def _embedded(schema: Any) -> str:
    """A JSON Schema inside Lark, compiled with the same JSON options as a plain JSON constraint."""
    return "%json " + json.dumps({**_close_objects(schema), "x-guidance": JSON_OPTIONS})


def _harmony_grammar(spec: dict[str, Any]) -> str:
    """Lark for a gpt-oss reply (`harmony` in engine/core/request.py): its reasoning, then the message the constraint
    asks for. The prompt ends where the assistant's first header starts, so the reply opens with `<|channel|>`, or
    with ` to=functions.<name>` for a call; a message after the first starts with `<|start|>assistant`. `<|...|>`
    are the tokenizer's special tokens, which no text lexeme can match, so an analysis text ends exactly at its
    `<|end|>`."""
    last = []
    rules = ['analysis: <|channel|> "analysis" <|message|> TEXT <|end|>', "TEXT: /(?s:.*)/"]
    if spec["answer"] is not None:
        last.append("final")
        rules.append(f'final: <|channel|> "final" <|message|> {_embedded(spec["answer"])} <|return|>')
    for i, (name, schema) in enumerate(spec["calls"].items()):
        last.append(f"call{i}")
        recipient = json.dumps(" to=functions." + name)
        # The recipient before the channel (as the prompt renders earlier calls) or after it (as Harmony's own
        # examples show gpt-oss writing them); the content type optional, as the format has it.
        rules.append(
            f'call{i}: ({recipient} <|channel|> "commentary" | <|channel|> "commentary" {recipient}) " "? '
            f'(<|constrain|> "json")? <|message|> {_embedded(schema)} <|call|>'
        )
    # One analysis message at most, as gpt-oss reasons once a turn: a model held off the message it would write next
    # could otherwise go on reasoning in message after message until its budget ran out.
    lines = ['start: (analysis <|start|> "assistant")? last', "last: " + " | ".join(last), *rules]
    return llguidance.LLMatcher.grammar_from_lark("\n".join(lines))


def _not_starting_with(tag: str) -> str:
    """A regex (Rust syntax, no lookahead) of every text that does not start with `tag`: a proper prefix of it,
    or a text that leaves it at some character."""
    prefixes = [_escape(tag[:i]) for i in range(len(tag))]
    branches = [*prefixes, *(f"{prefix}[^{_escape(tag[i])}](?s:.*)" for i, prefix in enumerate(prefixes))]
    return "(" + "|".join(branches) + ")"


def _escape(text: str) -> str:
    """`text` as a regex that matches it literally, every character but letters, digits and `_` as `\\x{..}`
    (so neither a newline nor the `/` that ends a Lark regex appears raw)."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"\\x{{{ord(c):X}}}" for c in text)


def _grammar(structured_output: StructuredOutput) -> str:
    """llguidance's grammar text for a regex, choice or grammar constraint (its shape already checked)."""
    kind, spec = structured_output.kind, structured_output.spec
    grammar_from = llguidance.LLMatcher
    if kind == "regex":
        return grammar_from.grammar_from_regex(spec)
    if kind == "choice":
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice exactly.
        return grammar_from.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    return grammar_from.grammar_from_lark(spec)


def _close_objects(schema: Any, close: bool = True) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists `properties` and says nothing
    about others. `allOf` branches stay open: each lists only some of the properties the object may have."""
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: value if key in _NOT_SCHEMAS else _close_objects_in(key, value) for key, value in schema.items()}
    # Beside allOf or $ref, properties listed elsewhere count too: closing here would forbid them.
    if close and "properties" in closed and not {"additionalProperties", "allOf", "$ref"} & closed.keys():
        closed["additionalProperties"] = False
    return closed


def _close_objects_in(key: str, value: Any) -> Any:
    if key == "allOf" and isinstance(value, list):
        return [_close_objects(branch, close=False) for branch in value]
    if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(
        value, dict
    ):
        # Maps of name -> subschema: the names themselves are data.
        return {name: _close_objects(subschema) for name, subschema in value.items()}
    return _close_objects(value)
