"""`ferry serve`: the OpenAI-compatible server's command line (ferry/cli.py hangs it under the `ferry` command).

Every field of EngineConfig's parts and of ServerSettings is a flag, documented where the field is
(server/flags.py); only --model is written here, because without it the model embedded in the package is served.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import PART_CLASSES, EngineConfig
from engine.models.gguf import has_tokenizer
from server.flags import add_flags, flag_values
from server.settings import ServerSettings

if TYPE_CHECKING:
    from server.client import EngineProcess

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
        "/v1/responses, /v1/models, /health, /ready, /metrics, /version).",
        formatter_class=_HelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="A local Hugging Face model directory (config.json, safetensors, tokenizer), or a Hub id (org/name) "
        "read from the Hugging Face cache and downloaded into it when the Hub can be reached (see --revision, "
        f"--download-dir, HF_HUB_OFFLINE). Without it, the small model embedded in the package ({DEFAULT_MODEL_DIR}) "
        "is served.",
    )
    groups = {"model": model}
    for part in PART_CLASSES.values():
        add_flags(parser, part, groups)
    add_flags(parser, ServerSettings, groups)
    parser.set_defaults(func=run_serve, parser=parser)


def _model_spec(args: argparse.Namespace) -> str:
    """--model as given, or the embedded default model's directory."""
    if args.model is not None:
        return args.model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        args.parser.error(f"no --model given, and the embedded default model is missing ({DEFAULT_MODEL_DIR}).")
    return str(DEFAULT_MODEL_DIR)


def _resolve(args: argparse.Namespace, flag: str, spec: str, revision: str | None, weights: bool) -> str:
    """A local directory for `spec`: itself, or its snapshot in the Hugging Face cache (fetched if need be)."""
    import huggingface_hub.constants

    from server.model_source import ModelSourceError, resolve

    try:
        path = resolve(
            spec,
            flag=flag,
            revision=revision,
            download_dir=args.download_dir,
            offline=huggingface_hub.constants.HF_HUB_OFFLINE,
            weights=weights,
        )
    except ModelSourceError as exc:
        args.parser.error(str(exc))
    return str(path)


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's options, with --model resolved to a local directory (a Hub model is fetched here, once)."""
    values = {name: value for part in PART_CLASSES.values() for name, value in flag_values(part, args).items()}
    model_dir = _resolve(args, "--model", _model_spec(args), args.revision, weights=values["load_format"] != "dummy")
    speculative = values["speculative_config"]
    if speculative is not None and speculative.model is not None:
        # The draft model is found as --model is: a directory, or a Hub id's snapshot.
        draft_dir = _resolve(args, "--speculative-config's model", speculative.model, None, weights=True)
        values["speculative_config"] = dataclasses.replace(speculative, model=draft_dir)
    try:
        return EngineConfig.of(model=model_dir, **values)
    except ValueError as exc:
        args.parser.error(str(exc))


def _check_parallel_layout(args: argparse.Namespace, config: EngineConfig) -> None:
    try:
        config.parallel.check_layout()
    except ValueError as exc:
        args.parser.error(str(exc))


def build_settings(args: argparse.Namespace) -> ServerSettings:
    from server.model_source import default_served_name

    values = flag_values(ServerSettings, args)
    # The environment variable keeps the key out of `ps` output and shell history.
    values["api_key"] = args.api_key or os.environ.get("FERRY_API_KEY") or None
    values["database_url"] = args.database_url or os.environ.get("FERRY_DATABASE_URL") or None
    values["served_model_name"] = values["served_model_name"] or (default_served_name(_model_spec(args)),)
    try:
        return ServerSettings(**values)
    except ValueError as exc:
        args.parser.error(str(exc))


def resolve_tokenizer(args: argparse.Namespace, settings: ServerSettings) -> ServerSettings:
    """`settings` with --tokenizer resolved to a local directory, when one was given."""
    if settings.tokenizer is None:
        if settings.tokenizer_revision is not None:
            args.parser.error("--tokenizer-revision applies to a --tokenizer only")
        return settings
    path = _resolve(args, "--tokenizer", settings.tokenizer, settings.tokenizer_revision, weights=False)
    return dataclasses.replace(settings, tokenizer=path)


def run_serve(args: argparse.Namespace) -> int:
    # The web stack is imported only after the engine process is spawned (below), and not at the top: spawn re-runs
    # the `ferry` script's imports in the engine process, this module among them, and the engine needs neither the
    # web stack nor the tokenizer libraries.
    from server.collector import paused_collector
    from server.logs import configure_logging

    engine_config = build_engine_config(args)
    _check_parallel_layout(args, engine_config)
    settings = resolve_tokenizer(args, build_settings(args))
    if settings.tokenizer is None and not has_tokenizer(engine_config.model.path):
        args.parser.error(f"--model {_model_spec(args)}: its tokenizer could not be read; pass --tokenizer")
    configure_logging(settings.log_level, settings.log_format)
    if engine_config.parallel.node_rank > 0:
        # Another node of a multi-node tensor-parallel run: its ranks only, no HTTP; node 0 serves.
        from engine.distributed.worker import run_node

        return run_node(engine_config)
    engine = _spawn_engine(engine_config, settings)

    with paused_collector():
        import uvicorn

        from server.app import create_app
        from server.lifecycle import FerryServer, Lifecycle
        from server.lora import LoRAStartupError
        from server.state.database import database_url
        from server.state.keys import read_keys

    lifecycle = Lifecycle(settings.drain_timeout)
    try:
        read_keys(settings.api_key, settings.api_keys_file)
        database_url(settings.database_url, settings.state_dir)
        app = create_app(engine_config, settings, lifecycle, engine)
    except (LoRAStartupError, ValueError) as exc:
        engine.kill()
        args.parser.error(str(exc))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # No logging config of uvicorn's own: its loggers (the access log included) go through ours.
        log_config=None,
        timeout_graceful_shutdown=UVICORN_GRACEFUL_SHUTDOWN_SECONDS,
        lifespan="on",
    )
    FerryServer(config, lifecycle).run()
    return lifecycle.exit_code


def _spawn_engine(engine_config: EngineConfig, settings: ServerSettings) -> EngineProcess:
    """The engine process, spawned before the front end imports its web stack, tokenizer and templates: the two
    processes' imports (seconds each, single-threaded) then run side by side on two cores instead of one after the
    other."""
    from server.client import EngineProcess

    return EngineProcess.spawn(
        engine_config, log_level=settings.log_level, log_format=settings.log_format, step_log=settings.step_log
    )
