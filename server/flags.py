"""Command-line flags generated from an options dataclass, so that each option is documented once, where it is.

Every field becomes `--field-name`: its type from the annotation (`bool` -> `--x/--no-x`, `Literal[...]` ->
choices, `X | None` -> X, `tuple[X, ...]` -> one or more X, a class with `from_json` -> its JSON text, a class
with `from_flag` -> the text that method reads), its default from the field, its help from the field's attribute
docstring (the string right after it), its help section from `metadata["group"]`, and other names it accepts from
`metadata["aliases"]`. A tuple field with `metadata["repeatable"]` collects the values of every use of its flag
(`--x a b --x c`); any other flag's last use wins. A field with `metadata["flag"] = False` is left to the caller.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal


def flag_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, groups: dict[str, argparse._ArgumentGroup]) -> None:
    """Add one flag per field of `cls` to its help section in `groups`, creating sections in order of first use."""
    docs = attribute_docstrings(cls)
    hints = typing.get_type_hints(cls)
    for field in flag_fields(cls):
        if field.name not in docs:
            raise TypeError(f"{cls.__name__}.{field.name} has no docstring: it is the help of {flag_name(field.name)}")
        if field.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{field.name} has no default, so it cannot be an optional flag")
        group_name = field.metadata["group"]
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        options = _type_options(hints[field.name])
        if field.metadata.get("repeatable"):
            options["action"] = "extend"
        groups[group_name].add_argument(
            flag_name(field.name),
            *field.metadata.get("aliases", ()),
            dest=field.name,
            default=field.default,
            # argparse %-formats help texts (for `%(default)s`): a literal % must be doubled.
            help=docs[field.name].replace("%", "%%"),
            **options,
        )


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed value of each of `cls`'s flags, by field name: `cls(**flag_values(cls, args), ...)`."""
    values = {field.name: getattr(args, field.name) for field in flag_fields(cls)}
    # argparse collects `nargs="+"` values in a list; the dataclasses hold tuples (they are frozen values).
    return {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}


def _type_options(annotation: Any) -> dict[str, Any]:
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return {"type": type(choices[0]), "choices": choices}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        # `X | None`: None is the default only (its meaning is in the help); a value on the command line is an X.
        (value_type,) = (arg for arg in typing.get_args(annotation) if arg is not type(None))
        return _type_options(value_type)
    if typing.get_origin(annotation) is tuple:
        # `tuple[X, ...]`: one or more values after the flag (`--served-model-name a b`).
        value_type, ellipsis = typing.get_args(annotation)
        assert ellipsis is Ellipsis, f"only variadic tuples are flags, got {annotation!r}"
        return {**_type_options(value_type), "nargs": "+"}
    if annotation in (int, float, str):
        return {"type": annotation}
    if hasattr(annotation, "from_json"):
        # An options object given as one JSON argument (`--speculative-config '{"method": "ngram"}'`).
        return {"type": functools.partial(_parsed, annotation.from_json)}
    if hasattr(annotation, "from_flag"):
        # A value with a text form of its own (`--lora-modules name=path`).
        return {"type": functools.partial(_parsed, annotation.from_flag)}
    raise TypeError(f"no command-line flag for a field of type {annotation!r}")


def _parsed(parse: Callable[[str], Any], text: str) -> Any:
    # argparse shows an ArgumentTypeError's own message; a ValueError would be "invalid value" alone.
    try:
        return parse(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """Each field's attribute docstring: the string literal right after its annotated assignment in the class body."""
    (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(class_def, ast.ClassDef)
    return dict(_documented_names(class_def.body))


def _documented_names(body: list[ast.stmt]) -> Iterator[tuple[str, str]]:
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            yield statement.target.id, inspect.cleandoc(following.value.value)
