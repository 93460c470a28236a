"""Structured-output measurements behind BENCHMARKS.md "Structured output".

    python scripts/bench_structured_output.py make-model OUT_DIR            # demo config, 32k-token vocabulary
    python scripts/bench_structured_output.py libraries TOKENIZER_DIR...   # xgrammar vs llguidance
    python scripts/bench_structured_output.py engine MODEL_DIR              # what constrained rows cost a step

`libraries` needs both grammar libraries (`pip install xgrammar llguidance`; Ferry itself depends on llguidance
only). It times compiling four JSON schemas per tokenizer, one batched bitmask fill for 32 sequences per step (8 per
schema, each at its own position along a valid answer), and checks which JSON-Schema features each library
enforces. `engine` runs 32 greedy requests through EngineCore, all constrained by a JSON schema or none, and
reports the sample phase per decode step (grammar fill, bias and matcher advance included), with random weights
(load_format="dummy"), so `make-model`'s directory (config and tokenizer only) serves too: the demo model's config
with a byte-level BPE vocabulary of Llama's size trained on the Python standard library's sources.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEMO_MODEL = Path(__file__).resolve().parents[1] / "server" / "default_model"

SCHEMAS: dict[str, dict] = {
    "nested + optional": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 30},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 30},
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["street", "city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "arrays (maxItems)": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 5},
            "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}, "maxItems": 3},
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                "maxItems": 3,
            },
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums + bounds": {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "pending"]},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "kind": {"const": "task"},
            "flag": {"type": "boolean"},
        },
        "required": ["status", "priority", "ratio", "kind"],
        "additionalProperties": False,
    },
    "tool call ($defs, anyOf)": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "customer": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 4},
            "shipping": {"type": "string", "enum": ["standard", "express"]},
            "note": {"type": "string", "maxLength": 40},
        },
        "required": ["items", "shipping"],
        "additionalProperties": False,
    },
}
ANSWERS: dict[str, Any] = {
    "nested + optional": {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.com",
        "address": {"street": "12 St James Square", "city": "London", "zip": "12345"},
    },
    "arrays (maxItems)": {"tags": ["alpha", "beta", "gamma"], "scores": [12.5, 99, 0.25], "matrix": [[1, 2, 3], [4]]},
    "enums + bounds": {"status": "pending", "priority": 3, "ratio": 0.75, "kind": "task", "flag": True},
    "tool call ($defs, anyOf)": {
        "customer": "Grace Hopper",
        "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-200", "qty": 10}],
        "shipping": "express",
        "note": "leave at the door",
    },
}
SEPARATORS = (", ", ": ")
"""What both libraries are configured to emit: json.dumps' defaults, no other whitespace."""


def _closed(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


FEATURES: list[tuple[str, dict, Any, Any]] = [
    # (feature, schema, a valid answer, an invalid one: str for raw text)
    ("string maxLength", _closed({"a": {"type": "string", "maxLength": 3}}), {"a": "abc"}, {"a": "abcd"}),
    ("string minLength", _closed({"a": {"type": "string", "minLength": 2}}), {"a": "ab"}, {"a": "a"}),
    ("pattern", _closed({"a": {"type": "string", "pattern": "^[0-9]{3}$"}}), {"a": "123"}, {"a": "12a"}),
    ("format date", _closed({"a": {"type": "string", "format": "date"}}), {"a": "2024-01-31"}, {"a": "today"}),
    ("format email", _closed({"a": {"type": "string", "format": "email"}}), {"a": "a@b.co"}, {"a": "nope"}),
    ("integer minimum/maximum", _closed({"a": {"type": "integer", "minimum": 1, "maximum": 5}}), {"a": 5}, {"a": 6}),
    ("exclusiveMinimum", _closed({"a": {"type": "integer", "exclusiveMinimum": 0}}), {"a": 1}, {"a": 0}),
    ("number minimum/maximum", _closed({"a": {"type": "number", "minimum": 0, "maximum": 1}}), {"a": 0.5}, {"a": 2}),
    ("multipleOf", _closed({"a": {"type": "integer", "multipleOf": 5}}), {"a": 15}, {"a": 7}),
    ("enum", _closed({"a": {"enum": ["x", 1, None]}}), {"a": 1}, {"a": "y"}),
    ("const", _closed({"a": {"const": "task"}}), {"a": "task"}, {"a": "tas"}),
    (
        "minItems/maxItems",
        _closed({"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
        {"a": [1, 2]},
        {"a": [1, 2, 3]},
    ),
    (
        "uniqueItems",
        _closed({"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
        {"a": [1, 2]},
        {"a": [1, 1]},
    ),
    (
        "prefixItems",
        _closed({"a": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}}),
        {"a": [1, "x"]},
        {"a": ["x", 1]},
    ),
    ("optional property", _closed({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a"]), {"a": 1}, {"b": 1}),
    ("additionalProperties: false", _closed({"a": {"type": "integer"}}), {"a": 1}, {"a": 1, "z": 2}),
    (
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"k": 1},
        {"k": 1, "j": 2},
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
        {"x_a": 1},
        {"y": 1},
    ),
    ("anyOf", _closed({"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}), {"a": None}, {"a": "s"}),
    ("oneOf", _closed({"a": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"a": True}, {"a": "s"}),
    ("allOf", {"allOf": [_closed({"a": {"type": "integer"}})]}, {"a": 1}, {"a": "1"}),
    (
        "$ref, recursive",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}]},
        {"v": 1, "kids": [{"w": 2}]},
    ),
    ("not", _closed({"a": {"not": {"type": "string"}}}), {"a": 1}, {"a": "s"}),
    ("if/then", {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {}, None),
    ("no free whitespace", _closed({"a": {"type": "integer"}}), {"a": 1}, '{"a":  1}'),
]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


class _XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.xgr = xgrammar
        started = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
        )
        self.setup_seconds = time.perf_counter() - started
        self.vocab_size = len(tokenizer)

    def compile(self, schema: dict):
        # A fresh compiler each time, its cache off: compile time, not lookups.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def filler(self) -> Callable[[list, Any], None]:
        batch = self.xgr.BatchGrammarMatcher(max_threads=1)
        return batch.batch_fill_next_token_bitmask

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.setup_seconds = time.perf_counter() - started
        self.words = -(-len(tokenizer) // 32)

    def compile(self, schema: dict):
        options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        # llguidance builds its lexer lazily, at the first mask: part of what compiling costs.
        import numpy as np

        mask = np.zeros((1, self.words), dtype=np.int32)
        self.llg.LLExecutor(1).unsafe_compute_mask_ptr([(matcher, 0)], mask.ctypes.data, self.words * 4, 1)
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def filler(self) -> Callable[[list, Any], None]:
        executor = self.llg.LLExecutor(1)

        def fill(matchers: list, bitmask) -> None:
            pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
            executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, self.words * 4, len(matchers))

        return fill

    def bitmask(self, rows: int):
        import numpy as np

        return np.zeros((rows, self.words), dtype=np.int32)


def _compile_seconds(library, schema: dict) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        library.compile(schema)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _fill_seconds(library, tokenizer, batch: int = 32) -> tuple[float, float, int]:
    """Median and max of one batched fill for `batch` sequences per step, and the number of steps timed."""
    names = list(SCHEMAS)
    compiled = {name: library.compile(SCHEMAS[name]) for name in names}
    answers = {
        name: tokenizer.encode(json.dumps(ANSWERS[name], separators=SEPARATORS), add_special_tokens=False)
        for name in names
    }
    sequences = []
    for i in range(batch):
        name = names[i % len(names)]
        matcher, offset = library.matcher(compiled[name]), i // len(names)
        for token in answers[name][:offset]:
            assert library.accept(matcher, token)
        sequences.append((matcher, answers[name], offset))
    fill, bitmask = library.filler(), library.bitmask(batch)
    times = []
    step = 0
    while all(offset + step < len(answer) for _, answer, offset in sequences):
        started = time.perf_counter()
        fill([matcher for matcher, _, _ in sequences], bitmask)
        times.append(time.perf_counter() - started)
        for matcher, answer, offset in sequences:
            assert library.accept(matcher, answer[offset + step])
        step += 1
    return statistics.median(times), max(times), len(times)


def _verdict(library, tokenizer, schema: dict, valid: Any, invalid: Any) -> str:
    def accepts(compiled, answer: Any) -> bool:
        text = answer if isinstance(answer, str) else json.dumps(answer, separators=SEPARATORS)
        matcher = library.matcher(compiled)
        tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return all(library.accept(matcher, token) for token in tokens)

    try:
        compiled = library.compile(schema)
    except Exception as exc:
        return f"refused: {str(exc).splitlines()[0][:60]}"
    takes_valid = accepts(compiled, valid)
    if invalid is None:
        return "compiles" + ("" if takes_valid else ", REJECTS VALID")
    enforced = not accepts(compiled, invalid)
    return ("enforced" if enforced else "NOT ENFORCED") + ("" if takes_valid else ", REJECTS VALID")


def libraries(tokenizer_dirs: list[str]) -> None:
    from transformers import AutoTokenizer

    for directory in tokenizer_dirs:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        print(f"\n## {directory} (vocabulary {len(tokenizer)})\n")
        libs = [_XGrammar(tokenizer), _LLGuidance(tokenizer)]
        print("| | " + " | ".join(lib.name for lib in libs) + " |\n|---|" + "---:|" * len(libs))
        print("| tokenizer setup | " + " | ".join(_ms(lib.setup_seconds) for lib in libs) + " |")
        for name, schema in SCHEMAS.items():
            print(f"| compile: {name} | " + " | ".join(_ms(_compile_seconds(lib, schema)) for lib in libs) + " |")
        fills = [_fill_seconds(lib, tokenizer) for lib in libs]
        print("| fill 32 rows, median | " + " | ".join(_ms(median) for median, _, _ in fills) + " |")
        print("| fill 32 rows, max | " + " | ".join(_ms(worst) for _, worst, _ in fills) + " |")
    print("\n| JSON-Schema feature | " + " | ".join(lib.name for lib in libs) + " |\n|---|" + "---|" * len(libs))
    for feature, schema, valid, invalid in FEATURES:
        print(f"| {feature} | " + " | ".join(_verdict(lib, tokenizer, schema, valid, invalid) for lib in libs) + " |")


def engine(model_dir: str, steps: int) -> None:
    from engine import EngineConfig, EngineCore, SamplingParams, StructuredOutput, generate_batch

    class SamplePhase:
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step(self, record) -> None:
            plan = record.plan
            if plan.request_ids and not plan.new_requests and len(plan.request_ids) == plan.num_sampling == 32:
                self.seconds.append(record.result.sample_seconds)

    schema = StructuredOutput("json_schema", json.dumps(SCHEMAS["tool call ($defs, anyOf)"]))
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(32)]
    for label, structured_output in (("unconstrained", None), ("json_schema", schema)):
        phase = SamplePhase()
        config = EngineConfig.of(model=model_dir, num_pages=1024, load_format="dummy")
        core = EngineCore(config, observers=[phase])
        params = SamplingParams(max_new_tokens=steps, structured_output=structured_output)
        generate_batch(prompts, params=params, engine=core)
        print(
            f"{label}: sample phase per 32-row decode step: median {_ms(statistics.median(phase.seconds))}, "
            f"p90 {_ms(statistics.quantiles(phase.seconds, n=10)[-1])} over {len(phase.seconds)} steps"
        )


def make_model(out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def sources() -> Iterator[str]:
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
            with open(path, encoding="utf-8", errors="replace") as file:
                yield file.read()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<|pad|>", "<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sources(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=special[0], bos_token=special[1], eos_token=special[2]
    )
    fast.save_pretrained(out_dir)
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    Path(out_dir, "config.json").write_text(json.dumps({**config, "vocab_size": len(fast)}, indent=2))
    shutil.copy(DEMO_MODEL / "generation_config.json", out_dir)
    print(f"{out_dir}: vocabulary {len(fast)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser("libraries", help="xgrammar vs llguidance")
    compare.add_argument("tokenizer_dirs", nargs="+")
    step = commands.add_parser("engine", help="what constrained rows cost an engine step")
    step.add_argument("model_dir")
    step.add_argument("--steps", type=int, default=64)
    model = commands.add_parser("make-model", help="a config-and-tokenizer model directory with a large vocabulary")
    model.add_argument("out_dir")
    model.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    if args.command == "libraries":
        libraries(args.tokenizer_dirs)
    elif args.command == "engine":
        engine(args.model_dir, args.steps)
    else:
        make_model(args.out_dir, args.vocab_size)


if __name__ == "__main__":
    main()
