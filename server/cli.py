"""`ferry serve`: the OpenAI-compatible server's command line (ferry/cli.py hangs it under the `ferry` command).

Every EngineConfig and ServerSettings field is a flag, documented where the field is (server/flags.py); only
--model is written here, because without it the model embedded in the package is served.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from engine.config import EngineConfig
from server.flags import add_flags, flag_values
from server.settings import ServerSettings

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# After a drain, connections still open are idle keep-alives or finishing an error: they get this long.
UVICORN_GRACEFUL_SHUTDOWN_SECONDS = 5


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default except None, whose meaning each flag's help spells out."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /ready, /metrics, /version).",
        formatter_class=_HelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="Local Hugging Face model directory (config.json, safetensors, tokenizer). Without it, the small "
        f"model embedded in the package ({DEFAULT_MODEL_DIR}) is served.",
    )
    groups = {"model": model}
    add_flags(parser, EngineConfig, groups)
    add_flags(parser, ServerSettings, groups)
    parser.set_defaults(func=run_serve, parser=parser)


def _model_dir(args: argparse.Namespace) -> Path:
    parser: argparse.ArgumentParser = args.parser
    if args.model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            parser.error(f"no --model given, and the embedded default model is missing ({DEFAULT_MODEL_DIR}).")
        return DEFAULT_MODEL_DIR
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model directory (no config.json).")
    return model_dir


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return EngineConfig(model=str(_model_dir(args)), **flag_values(EngineConfig, args))
    except ValueError as exc:
        args.parser.error(str(exc))


def _check_parallel_layout(args: argparse.Namespace, config: EngineConfig) -> None:
    try:
        config.check_parallel_layout()
    except ValueError as exc:
        args.parser.error(str(exc))


def build_settings(args: argparse.Namespace) -> ServerSettings:
    values = flag_values(ServerSettings, args)
    # The environment variable keeps the key out of `ps` output and shell history.
    values["api_key"] = args.api_key or os.environ.get("FERRY_API_KEY") or None
    try:
        return ServerSettings(**values)
    except ValueError as exc:
        args.parser.error(str(exc))


def run_serve(args: argparse.Namespace) -> int:
    # Imported here, not at the top: multiprocessing's spawn re-runs the `ferry` script's imports in the engine
    # process, this module among them, and the engine needs neither the web stack nor the tokenizer libraries.
    import uvicorn

    from server.app import create_app
    from server.lifecycle import FerryServer, Lifecycle

    engine_config = build_engine_config(args)
    _check_parallel_layout(args, engine_config)
    settings = build_settings(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    if engine_config.node_rank > 0:
        # Another node of a multi-node tensor-parallel run: its ranks only, no HTTP; node 0 serves.
        from engine.worker import run_node

        return run_node(engine_config, settings.log_level)
    lifecycle = Lifecycle(settings.drain_timeout)
    app = create_app(engine_config, settings, lifecycle)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=UVICORN_GRACEFUL_SHUTDOWN_SECONDS,
        lifespan="on",
    )
    FerryServer(config, lifecycle).run()
    return lifecycle.exit_code
