"""`ferry serve` flags: every engine option is one, with a sane default, and bad values are refused up front."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import ferry.cli
from engine.config import EngineConfig
from server import cli


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers())
    return parser


def test_every_engine_option_is_a_documented_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ferry.cli.main(["serve", "--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(EngineConfig):
        assert f"--{field.name.replace('_', '-')}" in help_text, field.name
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--request-timeout", "--max-request-bytes",
                 "--drain-timeout", "--log-level"):  # fmt: skip
        assert flag in help_text


def test_defaults_are_the_engine_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = serve_parser().parse_args(["serve", "--model", str(tmp_path)])
    assert cli.build_engine_config(args) == EngineConfig(model=str(tmp_path))
    settings = cli.build_settings(args)
    assert (settings.host, settings.port, settings.api_key) == ("127.0.0.1", 8000, None)


def test_flags_reach_the_engine_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = serve_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--page-size", "32", "--num-blocks", "100", "--no-enable-prefix-caching",
         "--scheduler-policy", "prefill_first", "--max-queue-size", "0", "--dtype", "bfloat16", "--debug-checks"]
    )  # fmt: skip
    config = cli.build_engine_config(args)
    assert (config.page_size, config.num_blocks, config.enable_prefix_caching) == (32, 100, False)
    assert (config.scheduler_policy, config.max_queue_size, config.dtype, config.debug_checks) == (
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
