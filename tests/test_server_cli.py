"""`ferry serve` flags: every engine option is one, with a sane default, and bad values are refused up front.

The flags are generated from EngineConfig's parts and ServerSettings (server/flags.py); these tests hold the
generator to one flag per field with the field's default, help and type, and the `ferry` command to its layering.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

import ferry.cli
from engine.config import PART_CLASSES, EngineConfig
from server import cli
from server.flags import flag_fields, flag_name
from server.settings import ServerSettings

OPTION_CLASSES = [*PART_CLASSES.values(), ServerSettings]
SERVER_DIR = Path(cli.__file__).resolve().parent


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    return parser


def serve_actions() -> dict[str, argparse.Action]:
    """The `serve` subcommand's options by dest (each bool flag is one action with --x and --no-x)."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    cli.add_serve_parser(subparsers)
    actions = [a for a in subparsers.choices["serve"]._actions if a.dest != "help"]
    assert len({a.dest for a in actions}) == len(actions), "one flag per option"
    return {action.dest: action for action in actions}


def test_every_engine_option_is_a_documented_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ferry.cli.main(["serve", "--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for field in (f for part in PART_CLASSES.values() for f in flag_fields(part)):
        assert f"--{field.name.replace('_', '-')}" in help_text, field.name
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--request-timeout", "--max-request-bytes",
                 "--drain-timeout", "--log-level"):  # fmt: skip
        assert flag in help_text


def test_defaults_are_the_engine_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = serve_parser().parse_args(["serve", "--model", str(tmp_path)])
    assert cli.build_engine_config(args) == EngineConfig.of(model=str(tmp_path))
    settings = cli.build_settings(args)
    assert (settings.host, settings.port, settings.api_key) == ("127.0.0.1", 8000, None)


def test_flags_reach_the_engine_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = serve_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--page-size", "32", "--num-blocks", "100", "--no-enable-prefix-caching",
         "--scheduler-policy", "prefill_first", "--max-queue-size", "0", "--dtype", "bfloat16", "--debug-checks"]
    )  # fmt: skip
    config = cli.build_engine_config(args)
    assert (config.cache.page_size, config.cache.num_pages, config.cache.enable_prefix_caching) == (32, 100, False)
    assert (
        config.scheduler.scheduler_policy,
        config.scheduler.max_queue_size,
        config.model.dtype,
        config.cache.debug_checks,
    ) == (
        "prefill_first",
        0,
        "bfloat16",
        True,
    )


@pytest.mark.parametrize(
    "flags",
    [["--page-size", "0"], ["--safety-margin", "1.5"], ["--request-timeout", "-1"], ["--max-request-bytes", "0"]],
)
def test_bad_values_are_refused_before_anything_starts(tmp_path: Path, flags: list[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = serve_parser().parse_args(["serve", "--model", str(tmp_path), *flags])
    with pytest.raises(SystemExit) as info:
        cli.build_engine_config(args)
        cli.build_settings(args)
    assert info.value.code == 2


def test_missing_model_directories_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.build_engine_config(serve_parser().parse_args(["serve", "--model", str(tmp_path / "nope")]))
    assert "not a model directory" in capsys.readouterr().err
    monkeypatch.setattr(cli, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    with pytest.raises(SystemExit):
        cli.build_engine_config(serve_parser().parse_args(["serve"]))
    assert "embedded default model is missing" in capsys.readouterr().err


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_field_is_one_flag_with_its_default_and_help(cls: type) -> None:
    actions = serve_actions()
    for field in dataclasses.fields(cls):
        if field not in flag_fields(cls):
            continue
        action = actions[field.name]
        assert action.option_strings[0] == flag_name(field.name), field.name
        assert action.default == field.default, field.name
        assert action.help and action.help.strip(), field.name


def test_only_the_model_directory_is_left_to_the_cli() -> None:
    excluded = {f.name for cls in OPTION_CLASSES for f in dataclasses.fields(cls) if f not in flag_fields(cls)}
    assert excluded == {"path"}  # ModelConfig.path: --model, resolved by the CLI
    assert "--model" in serve_actions()["model"].option_strings


def test_literals_are_choices_and_bools_are_on_off_pairs() -> None:
    actions = serve_actions()
    kinds = set()
    for cls in OPTION_CLASSES:
        for field in flag_fields(cls):
            annotation = typing.get_type_hints(cls)[field.name]
            action = actions[field.name]
            if typing.get_origin(annotation) is Literal:
                assert tuple(action.choices) == typing.get_args(annotation), field.name
                kinds.add("literal")
            elif annotation is bool:
                assert action.option_strings == [flag_name(field.name), "--no-" + flag_name(field.name)[2:]]
                kinds.add("bool")
    assert kinds == {"literal", "bool"}
    assert tuple(actions["scheduler_policy"].choices) == ("fifo", "prefill_first")


def test_num_pages_counts_kv_cache_pages_and_num_blocks_is_its_alias(tmp_path: Path) -> None:
    action = serve_actions()["num_pages"]
    assert "KV-cache pages" in action.help
    assert action.option_strings == ["--num-pages", "--num-blocks"]
    (tmp_path / "config.json").write_text("{}")
    for flag in ("--num-pages", "--num-blocks"):
        args = serve_parser().parse_args(["serve", "--model", str(tmp_path), flag, "7"])
        assert cli.build_engine_config(args).cache.num_pages == 7


FORMATTED = {"limit_mm_per_prompt": "image=2"}
"""Text options with a format of their own: a valid value other than the default."""


def _other_value(annotation: Any, default: Any) -> Any:
    """A valid value of the field's type that is not its default."""
    if annotation is bool:
        return not default
    if typing.get_origin(annotation) is Literal:
        return next(choice for choice in reversed(typing.get_args(annotation)) if choice != default)
    value_type = next(t for t in typing.get_args(annotation) or (annotation,) if t is not type(None))
    if typing.get_origin(value_type) is tuple:
        (item_type, _) = typing.get_args(value_type)
        if hasattr(item_type, "from_flag"):  # values with a text form of their own (--lora-modules name=path)
            return (item_type.from_flag("a=/set"), item_type.from_flag('{"name": "b", "path": "/other"}'))
        return ("set", "other")
    if hasattr(value_type, "from_json"):  # an options object: one with a required field set otherwise
        return value_type.from_json('{"method": "suffix", "num_speculative_tokens": 3}')
    if value_type is float:
        return default / 2 if default else 0.5  # fractions must stay below 1
    if value_type is int:
        return (default or 62) + 2  # counts, limits, a seed: any positive int is valid
    return f"{default}-set" if default else "set"


def _argv(values: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, tuple):
            argv += [
                flag_name(name),
                *(json.dumps(dataclasses.asdict(v)) if dataclasses.is_dataclass(v) else v for v in value),
            ]
        elif dataclasses.is_dataclass(value):
            argv += [flag_name(name), json.dumps(dataclasses.asdict(value))]
        else:
            argv += [flag_name(name), str(value)]
    return argv


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_flag_round_trips_into_the_dataclass(cls: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_API_KEY", raising=False)
    (tmp_path / "config.json").write_text("{}")
    hints = typing.get_type_hints(cls)
    values = {f.name: FORMATTED.get(f.name) or _other_value(hints[f.name], f.default) for f in flag_fields(cls)}
    args = serve_parser().parse_args(["serve", "--model", str(tmp_path), *_argv(values)])
    if cls in PART_CLASSES.values():
        assert cli.build_engine_config(args) == EngineConfig.of(model=str(tmp_path), **values)
    else:
        assert cli.build_settings(args) == ServerSettings(**values)


def test_the_api_key_falls_back_to_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_API_KEY", "from-env")
    assert cli.build_settings(serve_parser().parse_args(["serve"])).api_key == "from-env"
    assert cli.build_settings(serve_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"


def test_the_server_package_does_not_import_bench() -> None:
    """`ferry` (ferry/cli.py) joins serve and bench; the server itself must work without the benchmarks."""
    for path in SERVER_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(name == "bench" or name.startswith("bench.") for name in names), path


def test_ferry_runs_both_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ferry.cli.main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    assert "serve" in help_text and "bench" in help_text


def test_a_draft_model_is_found_as_the_model_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    spec = '{"method": "draft_model", "model": "%s"}'
    args = serve_parser().parse_args(
        ["serve", "--model", str(tmp_path / "target"), "--speculative-config", spec % (tmp_path / "draft")]
    )
    speculative = cli.build_engine_config(args).scheduler.speculative_config
    assert speculative is not None and speculative.model == str(tmp_path / "draft")
    args = serve_parser().parse_args(
        ["serve", "--model", str(tmp_path / "target"), "--speculative-config", spec % (tmp_path / "missing")]
    )
    with pytest.raises(SystemExit):
        cli.build_engine_config(args)
    assert "--speculative-config's model" in capsys.readouterr().err
