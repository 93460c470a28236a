"""Closing JSON within a budget: where a partial JSON value stands, and the shortest text that completes it so
that it validates against its schema.

A constrained request that runs out of tokens mid-value used to end with JSON that does not parse. The grammar
state (engine/sampling/token_masks.py) keeps a `JsonProgress` beside its matcher; when the tokens left are just
enough for `shortest_completion()`, it forces that text, so the answer closes and validates (and says `length`).

The text written so far is tracked as a stack of open containers plus the scalar being written, each with the
schemas it may still match (`anyOf` branches, `type` lists and `$ref`s flattened; object branches narrowed by the
keys and scalar values written). The completion is built from the innermost value outwards: finish the scalar,
then for each container its required members left (in `properties` order, which the grammar enforces), or its
`minItems`, and the closing bracket. Separators are the grammar's (`", "` and `": "`, no other whitespace:
engine/core/structured.py JSON_OPTIONS).

What it cannot construct (`pattern`, `multipleOf`, `minProperties`, an unknown `format`, a recursion with no
finite value) gives None: the request then runs as before, never forced into text the grammar would refuse
(the caller checks each completion against the matcher too). Pure Python, no torch: tests/test_json_closing.py.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

Schema = dict[str, Any] | bool

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_FORMAT_EXAMPLES = {
    "date": "2000-01-01",
    "time": "00:00:00Z",
    "date-time": "2000-01-01T00:00:00Z",
    "email": "a@a.a",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "uri": "a:",
    "ipv4": "0.0.0.0",
}
"""Short values of the string formats the grammar library checks, for a required member that must be written."""


def dumps(value: Any) -> str:
    """JSON text as the grammar writes it: `", "` and `": "` separators, nothing else."""
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=False)


class Schemas:
    """A root schema with its `$ref`s resolved and each subschema's shortest valid value (memoised)."""

    def __init__(self, root: Schema) -> None:
        self.root = root
        self._shortest: dict[int, str | None] = {}
        self._visiting: set[int] = set()

    def resolve(self, schema: Schema) -> Schema:
        """Follow local `$ref`s (`#/$defs/...`, `#/definitions/...`); sibling keywords are merged over the target."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < 64:
            target: Any = self.root
            for part in schema["$ref"].removeprefix("#").strip("/").split("/"):
                if not part:
                    continue
                target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **siblings} if isinstance(target, dict) and siblings else target
            seen += 1
        return schema

    def branches(self, schema: Schema) -> tuple[Schema, ...]:
        """The alternatives a value of `schema` may match: `anyOf` / `oneOf` branches and `type` lists expanded,
        `allOf` merged, each a schema without those keywords."""
        schema = self.resolve(schema)
        if not isinstance(schema, dict):
            return (schema,)
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part)
                if part is False:
                    return (False,)
                if isinstance(part, dict):
                    merged = _merge(merged, part)
            return self.branches(merged)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                base = {k: v for k, v in schema.items() if k != keyword}
                return tuple(
                    b
                    for branch in schema[keyword]
                    for b in self.branches(
                        _merge(base, self.resolve(branch))
                        if isinstance(self.resolve(branch), dict)
                        else self.resolve(branch)
                    )
                )
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return tuple(b for kind in kinds for b in self.branches({**schema, "type": kind}))
        return (schema,)

    def shortest(self, schema: Schema) -> str | None:
        """The shortest JSON text valid for `schema`, or None (impossible, or nothing this module can build)."""
        key = id(schema)
        if key in self._shortest:
            return self._shortest[key]
        if key in self._visiting:  # a required recursion: no finite value along this path
            return None
        self._visiting.add(key)
        try:
            found = _shortest_of([self._shortest_branch(branch) for branch in self.branches(schema)])
        finally:
            self._visiting.discard(key)
        self._shortest[key] = found
        return found

    def _shortest_branch(self, schema: Schema) -> str | None:
        if schema is True or schema == {}:
            return "0"
        if schema is False or not isinstance(schema, dict):
            return None
        if "const" in schema:
            return dumps(schema["const"])
        if "enum" in schema:
            return _shortest_of([dumps(value) for value in schema["enum"]])
        kind = schema.get("type")
        if kind == "null":
            return "null"
        if kind == "boolean":
            return "true"
        if kind in ("integer", "number"):
            return _shortest_number(schema)
        if kind == "string":
            closing = close_string('"', schema)
            return None if closing is None else '"' + closing
        if kind == "array":
            closing = self.close_array(schema, 0, "[")
            return None if closing is None else "[" + closing
        if kind == "object":
            closing = self.close_object(schema, (), "{")
            return None if closing is None else "{" + closing
        return "0"  # no type: any JSON value

    def member(self, schema: Schema, key: str) -> Schema:
        """The schema of an object's member `key`: its property, or `additionalProperties` (default any)."""
        if not isinstance(schema, dict):
            return schema
        properties = schema.get("properties") or {}
        return properties[key] if key in properties else schema.get("additionalProperties", True)

    def item(self, schema: Schema, index: int) -> Schema:
        """The schema of an array's item at `index`: its `prefixItems` entry, or `items` (default any)."""
        if not isinstance(schema, dict):
            return schema
        prefix = schema.get("prefixItems") or []
        return prefix[index] if index < len(prefix) else schema.get("items", True)

    def _member(self, schema: dict[str, Any], key: str) -> str | None:
        value = self.shortest(self.member(schema, key))
        return None if value is None else f"{dumps(key)}: {value}"

    def _tail(self, schema: dict[str, Any], keys: list[str]) -> str | None:
        """`, "k": v` for each key, then the closing brace."""
        members = [self._member(schema, key) for key in keys]
        return None if None in members else "".join(f", {m}" for m in members) + "}"

    def close_object(self, schema: Schema, written: tuple[str, ...], phase: str, key: str = "") -> str | None:
        """The shortest text that closes an object of `schema` (one branch) whose keys `written` are out, from
        `phase`: `{` (just opened), `key` (inside a key written as far as `key`, its quote included), `colon`,
        `colon_space`, `value` (its last key closed), `after` (a member complete), `comma_space`, `next_key`
        (after a comma: a member must come)."""
        if not isinstance(schema, dict):
            return "}" if schema is True and phase in ("{", "after") else None
        if "patternProperties" in schema or "propertyNames" in schema:
            return None
        order = list(schema.get("properties") or {})
        required = [k for k in schema.get("required", ()) if k not in written]
        if len(written) + len(required) < schema.get("minProperties", 0):
            return None
        # The grammar writes listed properties in their order: only those after the last one written may follow.
        last = max((order.index(k) for k in written if k in order), default=-1)
        later = [k for k in order[last + 1 :] if k not in written]
        if any(k not in later for k in required if k in order):
            return None
        required.sort(key=lambda k: order.index(k) if k in order else len(order))
        if phase == "{":
            members = [self._member(schema, k) for k in required]
            return None if None in members else ", ".join(members) + "}"  # type: ignore[arg-type]
        if phase == "after":
            return self._tail(schema, required)
        if phase in ("colon", "colon_space", "value"):
            value = self.shortest(self.member(schema, written[-1]))
            tail = self._tail(schema, required)
            if value is None or tail is None:
                return None
            return {"colon": ": ", "colon_space": " ", "value": ""}[phase] + value + tail
        # After a comma or inside a key: one member must come. Listed keys up to the first required one may,
        # or (with nothing required left) any later one, or a key of its own where others are allowed.
        names = later[: later.index(required[0]) + 1] if required and required[0] in later else later
        typed = key or ""
        options = [(name, dumps(name)[len(typed) :]) for name in names if dumps(name).startswith(typed or '"')]
        if schema.get("additionalProperties", True) is not False and not required:
            closing = close_string(typed or '"', {})
            if closing is not None:
                name = json.loads((typed or '"') + closing)
                if name not in order and name not in written:
                    options.append((name, closing if typed else '""'))
        lead = " " if phase == "comma_space" else ""
        candidates = []
        for name, rest_of_key in options:
            value = self.shortest(self.member(schema, name))
            tail = self._tail(schema, [k for k in required if k != name])
            if value is not None and tail is not None:
                candidates.append(f"{lead}{rest_of_key}: {value}{tail}")
        return _shortest_of(candidates)

    def close_array(self, schema: Schema, count: int, phase: str) -> str | None:
        """The shortest text that closes an array of `schema` (one branch) with `count` items out, from `phase`:
        `[` (just opened), `after` (an item complete), `comma_space`, `next_item` (after a comma: an item must
        come)."""
        if not isinstance(schema, dict):
            return "]" if schema is True and phase in ("[", "after") else None
        needed = max(0, schema.get("minItems", 0) - count)
        if phase in ("comma_space", "next_item"):
            needed = max(needed, 1)
        values = [self.shortest(self.item(schema, index)) for index in range(count, count + needed)]
        if None in values:
            return None
        if phase == "after":
            return "".join(f", {v}" for v in values) + "]"
        return (" " if phase == "comma_space" else "") + ", ".join(values) + "]"  # type: ignore[arg-type]


def _merge(base: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **part}
    if "properties" in base and "properties" in part:
        merged["properties"] = {**base["properties"], **part["properties"]}
    if "required" in base and "required" in part:
        merged["required"] = list(dict.fromkeys([*base["required"], *part["required"]]))
    return merged


def _shortest_of(options: list[str | None]) -> str | None:
    found = [o for o in options if o is not None]
    return min(found, key=len) if found else None


def close_string(typed: str, schema: dict[str, Any]) -> str | None:
    """The shortest text that closes a string written as far as `typed` (its opening quote included) so that it
    is valid for `schema`: the escape under way finished, `minLength` filled, the closing quote."""
    if "pattern" in schema:
        return None
    body, escape = typed[1:], ""
    length = i = 0
    while i < len(body):
        if body[i] == "\\":
            escape = body[i : i + 6] if body[i + 1 : i + 2] == "u" else body[i : i + 2]
            i += len(escape)
            if (escape.startswith("\\u") and len(escape) < 6) or len(escape) < 2:
                break
            escape = ""
        else:
            i += 1
        length += 1
    finish = ""
    if escape:  # `\\` alone, or `\\u` and fewer than four hex digits
        finish = "n" if escape == "\\" else "0" * (6 - len(escape))
        length += 1
    if "format" in schema:
        example = _FORMAT_EXAMPLES.get(schema["format"])
        return f'{example}"' if example is not None and typed == '"' else None
    if length > schema.get("maxLength", math.inf):
        return None
    return finish + "a" * max(0, schema.get("minLength", 0) - length) + '"'


def close_number(typed: str, schema: dict[str, Any]) -> str | None:
    """The shortest digits that complete a number written as far as `typed` within `schema`'s bounds (`-` with a
    range of [-5, -1] needs `1`; `1.` needs `0`), up to three of them."""
    integer = schema.get("type") == "integer"
    for length in range(4):
        for digits in itertools.product("0123456789", repeat=length):
            text = typed + "".join(digits)
            if not _NUMBER.fullmatch(text) or (integer and not re.fullmatch(r"-?(0|[1-9][0-9]*)", text)):
                continue
            if _in_range(schema, float(text)) and ("multipleOf" not in schema or float(text) == 0):
                return "".join(digits)
    return None


def _shortest_number(schema: dict[str, Any]) -> str | None:
    candidates = [0]
    for key in ("minimum", "exclusiveMinimum"):
        if isinstance(schema.get(key), (int, float)):
            candidates += [math.ceil(schema[key]), math.ceil(schema[key]) + 1]
    for key in ("maximum", "exclusiveMaximum"):
        if isinstance(schema.get(key), (int, float)):
            candidates += [math.floor(schema[key]), math.floor(schema[key]) - 1]
    for candidate in candidates:
        if _in_range(schema, candidate) and ("multipleOf" not in schema or candidate == 0):
            return str(candidate)
    return None


def _in_range(schema: dict[str, Any], value: float) -> bool:
    bounds = (
        ("minimum", lambda b: value >= b),
        ("exclusiveMinimum", lambda b: value > b),
        ("maximum", lambda b: value <= b),
        ("exclusiveMaximum", lambda b: value < b),
    )
    return all(not isinstance(schema.get(key), (int, float)) or holds(schema[key]) for key, holds in bounds)


Kind = Literal["object", "array", "string", "number", "literal"]
_LITERALS = {"true": True, "false": False, "null": None}


def allows(schema: Schema, kind: Kind) -> bool:
    """Whether a value of `schema` (one branch) may be of this kind of JSON."""
    if not isinstance(schema, dict):
        return bool(schema)
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return any(_kind_of(value) == kind for value in values)
    declared = schema.get("type")
    if declared is None:
        return True
    return {"integer": "number", "boolean": "literal", "null": "literal"}.get(declared, declared) == kind


def accepts(schema: Schema, value: Any) -> bool:
    """Whether a scalar `value` fits `schema` (one branch) as far as branch choice goes: const, enum and type."""
    if not isinstance(schema, dict):
        return bool(schema)
    if "const" in schema:
        return schema["const"] == value and type(schema["const"]) is type(value)
    if "enum" in schema:
        return any(v == value and type(v) is type(value) for v in schema["enum"])
    declared = schema.get("type")
    if declared is None:
        return True
    if value is None or isinstance(value, bool):
        return declared == ("null" if value is None else "boolean")
    if isinstance(value, (int, float)):
        return declared == "number" or (declared == "integer" and float(value).is_integer())
    return declared == "string"


def _kind_of(value: Any) -> Kind:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return "literal"
    return "number"


@dataclass(frozen=True, slots=True)
class Container:
    """An open object or array: the schema branches it may still match, where it stands, what it holds."""

    kind: Literal["object", "array"]
    branches: tuple[Schema, ...]
    phase: str
    """Object: `{`, `key`, `colon`, `colon_space`, `value`, `in`, `after`, `comma_space`, `next_key`; array: `[`,
    `in`, `after`, `comma_space`, `next_item` (`in`: a member's value is being written)."""
    keys: tuple[str, ...] = ()
    count: int = 0
    """Array items started."""


@dataclass(frozen=True, slots=True)
class Scalar:
    """A string (a value or a key), number or literal being written, as far as `text` goes."""

    kind: Literal["string", "number", "literal"]
    branches: tuple[Schema, ...]
    text: str
    is_key: bool = False


@dataclass(frozen=True, slots=True)
class JsonProgress:
    """Where a JSON value written so far stands, for one schema; `feed` returns the state after more text.

    Immutable, so the state after a candidate token costs no copy of the state before it.
    """

    schemas: Schemas
    stack: tuple[Container, ...] = ()
    scalar: Scalar | None = None
    started: bool = False
    done: bool = False
    broken: bool = False
    """Text this tracker does not follow (the grammar allowed it, so the tracker is what is wrong): no closing."""

    @classmethod
    def of(cls, schema: Schema) -> JsonProgress:
        return cls(Schemas(schema))

    def feed(self, text: str) -> JsonProgress:
        state = self
        for char in text:
            if state.broken:
                return state
            state = state._char(char)
        return state

    def shortest_completion(self) -> str | None:
        """The shortest text after which the value is complete and valid; "" once it is; None if unknown."""
        if self.broken:
            return None
        if self.done:
            return ""
        if not self.started:
            return self.schemas.shortest(self.schemas.root)
        return self._close_from(0, None)

    def _close_from(self, depth: int, fitting: tuple[Schema, ...] | None) -> str | None:
        """The shortest closing of the value open at `depth` (the scalar past the stack), over its branches that
        are among `fitting` (its parent's branch allows them; None: any), each branch closing its child with
        that branch's own member schemas: one choice of `anyOf` branch all the way down."""
        scalar = self.scalar
        if depth == len(self.stack):
            assert scalar is not None and not scalar.is_key
            return _shortest_of([_close_scalar(scalar, b) for b in _among(scalar.branches, fitting)])
        frame = self.stack[depth]
        has_child = depth + 1 < len(self.stack) or (scalar is not None and not scalar.is_key)
        key = scalar.text if scalar is not None and scalar.is_key else ""
        options = []
        for branch in _among(frame.branches, fitting):
            child = ""
            if has_child:
                if not isinstance(branch, dict):
                    child = self._close_from(depth + 1, None)
                elif frame.kind == "object":
                    child = self._close_from(depth + 1, self._member_branches(branch, frame))
                else:
                    child = self._close_from(
                        depth + 1, self.schemas.branches(self.schemas.item(branch, frame.count - 1))
                    )
            phase = "after" if has_child else frame.phase
            if frame.kind == "object":
                own = self.schemas.close_object(branch, frame.keys, phase, key)
            else:
                own = self.schemas.close_array(branch, frame.count, phase)
            if child is not None and own is not None:
                options.append(child + own)
        return _shortest_of(options)

    # --- one character at a time

    def _char(self, char: str) -> JsonProgress:
        scalar = self.scalar
        if scalar is not None:
            if scalar.kind == "string":
                text = scalar.text + char
                if char == '"' and _string_closed(text):
                    return self._string_done(scalar, json.loads(text))
                return replace(self, scalar=replace(scalar, text=text))
            if scalar.kind == "number":
                if char in "0123456789+-.eE":
                    return replace(self, scalar=replace(scalar, text=scalar.text + char))
                return self._value_done(
                    json.loads(scalar.text) if _NUMBER.fullmatch(scalar.text) else None, True
                )._char(char)
            text = scalar.text + char
            if text in _LITERALS:
                return self._value_done(_LITERALS[text], "literal")
            return replace(self, scalar=replace(scalar, text=text))
        if not self.started:
            return replace(self, started=True)._start_value(char, self.schemas.branches(self.schemas.root))
        if not self.stack:
            return replace(self, broken=True)  # text after the complete value
        frame = self.stack[-1]
        moves = _OBJECT_MOVES if frame.kind == "object" else _ARRAY_MOVES
        step = moves.get((frame.phase, char))
        if step == "close":
            return replace(self, stack=self.stack[:-1])._value_done(None, frame.kind)
        if step == "key":
            return self._top(phase="key", scalar=Scalar("string", (), '"', is_key=True))
        if step is not None:
            return self._top(phase=step)
        if frame.kind == "object" and frame.phase == "value":
            members = tuple(b for s in frame.branches for b in self._member_branches(s, frame))
            return self._top(phase="in")._start_value(char, members)
        if frame.kind == "array" and frame.phase in ("[", "next_item"):
            items = tuple(b for s in frame.branches for b in self.schemas.branches(self.schemas.item(s, frame.count)))
            return self._top(phase="in", count=frame.count + 1)._start_value(char, items)
        return replace(self, broken=True)

    def _member_branches(self, schema: Schema, frame: Container) -> tuple[Schema, ...]:
        return self.schemas.branches(self.schemas.member(schema, frame.keys[-1]))

    def _top(self, scalar: Scalar | None = None, **changes: Any) -> JsonProgress:
        return replace(self, stack=(*self.stack[:-1], replace(self.stack[-1], **changes)), scalar=scalar)

    def _start_value(self, char: str, branches: tuple[Schema, ...]) -> JsonProgress:
        if char == "{":
            frame = Container("object", tuple(b for b in branches if allows(b, "object")), "{")
            return replace(self, stack=(*self.stack, frame))
        if char == "[":
            frame = Container("array", tuple(b for b in branches if allows(b, "array")), "[")
            return replace(self, stack=(*self.stack, frame))
        kind: Kind | None = (
            "string" if char == '"' else "number" if char in "-0123456789" else "literal" if char in "tfn" else None
        )
        if kind is None:
            return replace(self, broken=True)
        return replace(self, scalar=Scalar(kind, tuple(b for b in branches if allows(b, kind)), char))

    def _string_done(self, scalar: Scalar, value: str) -> JsonProgress:
        if not scalar.is_key:
            return self._value_done(value, "string")
        frame = self.stack[-1]
        fitting = tuple(b for b in frame.branches if not isinstance(b, dict) or _may_have(b, value))
        return self._top(phase="colon", keys=(*frame.keys, value), branches=fitting or frame.branches)

    def _value_done(self, value: Any, kind: Kind) -> JsonProgress:
        """The value just closed (of `kind`: a scalar with its `value`, or a container) completes its parent's
        member or item, and narrows the parent's branches to those that take it: how a `required` call's name
        picks its tool, and an `anyOf` of arrays the one whose items fit."""
        state = replace(self, scalar=None)
        if not state.stack:
            return replace(state, done=True)
        frame = state.stack[-1]

        def takes(schema: Schema) -> bool:
            return accepts(schema, value) if kind in ("string", "number", "literal") else allows(schema, kind)

        def fits(branch: Schema) -> bool:
            if frame.kind == "object":
                return any(takes(m) for m in self._member_branches(branch, frame))
            return any(takes(m) for m in self.schemas.branches(self.schemas.item(branch, frame.count - 1)))

        fitting = tuple(b for b in frame.branches if fits(b))
        return state._top(phase="after", branches=fitting or frame.branches)


def _among(branches: tuple[Schema, ...], fitting: tuple[Schema, ...] | None) -> tuple[Schema, ...]:
    return branches if fitting is None else tuple(b for b in branches if b in fitting)


def _may_have(schema: dict[str, Any], key: str) -> bool:
    return key in (schema.get("properties") or {}) or schema.get("additionalProperties", True) is not False


def _string_closed(text: str) -> bool:
    """Whether the quote that ends `text` closes the string (it is not escaped)."""
    backslashes = len(text) - 1 - len(text[:-1].rstrip("\\"))
    return len(text) > 1 and backslashes % 2 == 0


def _close_scalar(scalar: Scalar, schema: Schema) -> str | None:
    if isinstance(schema, dict) and ("const" in schema or "enum" in schema):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [dumps(v) for v in values if _kind_of(v) == scalar.kind]
        return _shortest_of([t[len(scalar.text) :] for t in texts if t.startswith(scalar.text)])
    body = schema if isinstance(schema, dict) else {}
    if scalar.kind == "string":
        return close_string(scalar.text, body)
    if scalar.kind == "number":
        return close_number(scalar.text, body)
    words = [w for w, v in _LITERALS.items() if accepts(body, v)]
    return _shortest_of([w[len(scalar.text) :] for w in words if w.startswith(scalar.text)])


_OBJECT_MOVES = {
    ("{", '"'): "key",
    ("{", "}"): "close",
    ("colon", ":"): "colon_space",
    ("colon_space", " "): "value",
    ("after", ","): "comma_space",
    ("after", "}"): "close",
    ("comma_space", " "): "next_key",
    ("next_key", '"'): "key",
}
_ARRAY_MOVES = {
    ("[", "]"): "close",
    ("after", ","): "comma_space",
    ("after", "]"): "close",
    ("comma_space", " "): "next_item",
}


@dataclass(frozen=True, slots=True)
class TaggedCalls:
    """Tool calls in a model's own format: each call a JSON object between `begin` and `end` (Hermes:
    `<tool_call>\\n` and `\\n</tool_call>`), one after another when `repeat`; with `text`, any text that does not
    start with `begin` may be the answer instead."""

    begin: str
    schema: Schema
    end: str
    repeat: bool
    text: bool = False


@dataclass(frozen=True, slots=True)
class AnswerProgress:
    """Where an answer stands that is a JSON value (`answer`), tagged calls (`calls`), or either of the two.

    `mode`: `start` (nothing yet), `begin` / `end` (`matched` characters of that tag written), `call` or `answer`
    (`value` tracks the JSON), `between` (calls complete; another may begin), `text` (free text, where allowed:
    complete at every point).
    """

    answer: Schemas | None
    calls: TaggedCalls | None
    call_schemas: Schemas | None
    mode: str = "start"
    matched: int = 0
    value: JsonProgress | None = None
    calls_done: int = 0

    @classmethod
    def of(cls, answer: Schema | None, calls: TaggedCalls | None = None) -> AnswerProgress:
        return cls(None if answer is None else Schemas(answer), calls, None if calls is None else Schemas(calls.schema))

    def feed(self, text: str) -> AnswerProgress:
        state = self
        for char in text:
            if state.mode == "broken":
                return state
            state = state._char(char)
        return state

    def shortest_completion(self) -> str | None:
        mode, calls = self.mode, self.calls
        if mode == "broken":
            return None
        if mode in ("between", "text") or (
            calls is not None and calls.text and mode in ("start", "begin") and self.calls_done == 0
        ):
            return ""
        if mode in ("answer", "call"):
            assert self.value is not None
            closing = self.value.shortest_completion()
            if closing is None:
                return None
            if mode == "answer":
                return closing
            assert calls is not None
            return closing + calls.end
        if mode == "end":
            assert calls is not None
            return calls.end[self.matched :]
        options: list[str | None] = []
        if calls is not None and self.call_schemas is not None:
            value = self.call_schemas.shortest(calls.schema)
            if value is not None:
                options.append(calls.begin[self.matched :] + value + calls.end)
        if mode == "start" and self.answer is not None:
            options.append(self.answer.shortest(self.answer.root))
        return _shortest_of(options)

    def _char(self, char: str) -> AnswerProgress:
        calls = self.calls
        mode = self.mode
        if mode in ("start", "between") and calls is not None and char == calls.begin[0]:
            if mode == "between" and not calls.repeat:
                return replace(self, mode="broken")
            return self._tag("begin", 0, char)
        if mode == "start" and self.answer is not None:
            value = JsonProgress(self.answer).feed(char)
            return replace(self, mode="answer", value=value)
        if mode == "begin":
            return self._tag("begin", self.matched, char)
        if mode == "text" or (mode == "start" and calls is not None and calls.text):
            return replace(self, mode="text")
        if mode == "answer":
            assert self.value is not None
            return replace(self, value=self.value.feed(char))
        if mode == "call":
            assert self.value is not None and calls is not None
            if self.value.done:
                return self._tag("end", 0, char)
            return replace(self, value=self.value.feed(char))
        if mode == "end":
            return self._tag("end", self.matched, char)
        return replace(self, mode="broken")

    def _tag(self, tag: str, matched: int, char: str) -> AnswerProgress:
        assert self.calls is not None and self.call_schemas is not None
        text = self.calls.begin if tag == "begin" else self.calls.end
        if text[matched] != char:
            # Leaving the opening tag before its end is free text, where that may be the answer.
            free = tag == "begin" and self.calls.text and self.calls_done == 0
            return replace(self, mode="text" if free else "broken")
        matched += 1
        if matched < len(text):
            return replace(self, mode=tag, matched=matched)
        if tag == "begin":
            return replace(self, mode="call", matched=0, value=JsonProgress(self.call_schemas))
        return replace(self, mode="between", matched=0, value=None, calls_done=self.calls_done + 1)
