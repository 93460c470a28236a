"""Structured-output requests -> the engine's StructuredOutput, with every problem a 400 naming its field.

The surfaces: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. A request names at most one constraint. Schemas are checked against their JSON Schema draft
here; what the engine's grammar compiler cannot enforce is refused by `check_constraint` before anything runs.
The functions take plain values, so any endpoint (chat, completions, responses) can build on them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from engine.core import structured
from engine.core.request import RequestRejected, StructuredOutput, StructuredOutputKind
from server.openai.errors import APIError, invalid_request


@dataclass(frozen=True)
class Constraint:
    """A StructuredOutput and the request field it came from (for the errors found later)."""

    output: StructuredOutput
    param: str


def json_schema_constraint(schema: dict[str, Any] | str, param: str) -> Constraint:
    """A JSON Schema (an object, or its JSON text) checked against its draft's meta-schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid_request(f"'{param}' is not valid JSON: {exc}.", param, code="invalid_json_schema") from exc
    if not isinstance(schema, dict):
        raise invalid_request(f"'{param}' must be a JSON Schema object.", param, code="invalid_json_schema")
    check_json_schema(schema, param)
    return _constraint("json_schema", json.dumps(schema), param)


def tool_calls_constraint(
    tags: tuple[str, str],
    call: dict[str, Any],
    parallel: bool,
    answer: Constraint | None,
    param: str,
    text: bool = False,
) -> Constraint:
    """Calls in the model's own format (each call object between the `tags`); or where `answer` (a JSON
    constraint) is given, that JSON answer instead; or with `text`, any text that does not start a call."""
    spec = {
        "begin": tags[0],
        "end": tags[1],
        "call": call,
        "parallel": parallel,
        "answer": _schema(answer),
        "text": text,
    }
    return _constraint("tool_calls", json.dumps(spec), param)


def harmony_constraint(answer: Constraint | None, calls: dict[str, dict[str, Any]], param: str) -> Constraint:
    """A gpt-oss reply in Harmony's channels: reasoning, then a call to one of `calls` (function name -> arguments
    schema) or, where `answer` (a JSON constraint) is given, a final answer of that JSON."""
    return _constraint("harmony", json.dumps({"answer": _schema(answer), "calls": calls}), param)


JSON_KINDS = ("json_schema", "json_object")
"""The constraints an answer beside tool calls may take: JSON, which a call grammar can embed."""


def _schema(answer: Constraint | None) -> dict[str, Any] | None:
    """A JSON constraint's schema (any object for `json_object`); None for no answer."""
    if answer is None:
        return None
    return {"type": "object"} if answer.output.kind == "json_object" else json.loads(answer.output.spec)


def json_object_constraint(param: str) -> Constraint:
    return _constraint("json_object", "", param)


def regex_constraint(pattern: str, param: str) -> Constraint:
    return _constraint("regex", pattern, param)


def choice_constraint(choices: list[str], param: str) -> Constraint:
    return _constraint("choice", json.dumps(choices), param)


def grammar_constraint(grammar: str, param: str) -> Constraint:
    return _constraint("grammar", grammar, param)


def check_json_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` and the schema's first error, if it is not a valid JSON Schema."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise invalid_request(
            f"'{param}' is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "") + ".",
            param,
            code="invalid_json_schema",
        ) from exc


async def check_constraint(constraint: Constraint, tokenizer_dir: str) -> None:
    """Compile the constraint as the engine will (cached there), so that what its grammar library cannot enforce
    (`uniqueItems`, a bad regex, ...) is a 400 naming the field, before anything is queued or streamed."""
    try:
        await asyncio.to_thread(structured.check, constraint.output, tokenizer_dir)
    except RequestRejected as exc:
        raise invalid_request(
            f"'{constraint.param}' cannot be enforced: {str(exc).rstrip('.')}.",
            constraint.param,
            code="invalid_structured_output",
        ) from exc


def vllm_constraint(
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> Constraint | None:
    """vLLM's extras: `structured_outputs` (its keys given, unset ones left out) and the `guided_*` fields
    (`{"guided_json": ..., ...}`, unset ones left out). At most one constraint among all of them."""
    candidates = [(f"structured_outputs.{key}", key, value) for key, value in (structured_outputs or {}).items()]
    candidates += [(name, name.removeprefix("guided_"), value) for name, value in guided.items()]
    candidates = [c for c in candidates if c[2] is not None and c[2] is not False]
    if structured_outputs is not None and not candidates:
        raise invalid_request(
            "'structured_outputs' needs one of json, regex, choice, grammar or json_object.", "structured_outputs"
        )
    if not candidates:
        return None
    if len(candidates) > 1:
        raise conflicting_constraints(candidates[0][0], candidates[1][0])
    param, kind, value = candidates[0]
    if kind == "json":
        return json_schema_constraint(value, param)
    if kind == "json_object":
        return json_object_constraint(param)
    if kind == "regex":
        return regex_constraint(value, param)
    if kind == "choice":
        return choice_constraint(value, param)
    return grammar_constraint(value, param)


def conflicting_constraints(first: str, second: str) -> APIError:
    return invalid_request(
        f"'{second}' cannot be combined with '{first}': a request constrains its output in one way only.",
        second,
        code="conflicting_parameters",
    )


def _constraint(kind: StructuredOutputKind, spec: str, param: str) -> Constraint:
    try:
        return Constraint(StructuredOutput(kind, spec), param)
    except RequestRejected as exc:
        raise invalid_request(f"Invalid '{param}': {exc}.", param, code="invalid_structured_output") from exc
