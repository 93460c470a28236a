"""`ferry`, the command line: `ferry serve` runs the OpenAI-compatible server (and `ferry bench` the benchmarks,
when the bench package provides them)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from server.settings import ServerSettings

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
# After a drain, connections still open are idle keep-alives or finishing an error: they get this long.
UVICORN_GRACEFUL_SHUTDOWN_SECONDS = 5
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default except None, whose meaning each flag's help spells out."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _engine_default(name: str) -> Any:
    return EngineConfig.__dataclass_fields__[name].default


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
    model.add_argument(
        "--served-model-name", default=None, help="Name clients send as `model` (default: the model directory's name)."
    )
    model.add_argument(
        "--dtype",
        default=_engine_default("dtype"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="Weights and activations dtype; auto is bfloat16 on GPU, float32 on CPU.",
    )
    model.add_argument(
        "--device", default=_engine_default("device"), help="auto (cuda when available), cpu, or cuda[:N]."
    )
    model.add_argument(
        "--load-format",
        default=_engine_default("load_format"),
        choices=["auto", "dummy"],
        help="dummy builds random weights from config.json alone (benchmarking without weights).",
    )
    model.add_argument(
        "--model-impl",
        default=_engine_default("model_impl"),
        choices=["auto", "native", "transformers"],
        help="auto uses the native Llama-family modules where they exist, the transformers adapter otherwise.",
    )
    model.add_argument(
        "--attention-backend",
        default=_engine_default("attention_backend"),
        choices=["auto", "torch", "flash"],
        help="Attention kernels.",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=_engine_default("max_model_len"),
        help="Longest prompt + output in tokens (default: the model's max_position_embeddings).",
    )

    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--page-size", type=int, default=_engine_default("page_size"), help="Tokens per KV-cache page.")
    cache.add_argument(
        "--num-blocks",
        type=int,
        default=_engine_default("num_blocks"),
        help="Number of KV-cache pages (default: derived from the memory budget below).",
    )
    cache.add_argument(
        "--max-memory-percent",
        type=float,
        default=_engine_default("max_memory_percent"),
        help="GPU: fraction of free device memory, after loading the model, given to the KV cache.",
    )
    cache.add_argument(
        "--cpu-kv-cache-gib",
        type=float,
        default=_engine_default("cpu_kv_cache_gib"),
        help="CPU: GiB given to the KV cache.",
    )
    cache.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_engine_default("enable_prefix_caching"),
        help="Share KV-cache pages between requests with a common prompt prefix.",
    )

    scheduling = parser.add_argument_group("scheduling")
    scheduling.add_argument(
        "--max-batch-tokens",
        type=int,
        default=_engine_default("max_batch_tokens"),
        help="Token budget of one engine step: decode tokens plus prefill chunks.",
    )
    scheduling.add_argument(
        "--max-num-seqs", type=int, default=_engine_default("max_num_seqs"), help="Most sequences in one engine step."
    )
    scheduling.add_argument(
        "--scheduler-policy",
        default=_engine_default("scheduler_policy"),
        choices=["fifo", "prefill_first"],
        help="fifo: running requests first, then waiting ones in arrival order; prefill_first: waiting requests first.",
    )
    scheduling.add_argument(
        "--safety-margin",
        type=float,
        default=_engine_default("safety_margin"),
        help="Fraction of all pages kept free for running sequences to grow into; no new prefill is admitted below it.",
    )
    scheduling.add_argument(
        "--max-queue-size",
        type=int,
        default=_engine_default("max_queue_size"),
        help="Most requests waiting for admission; beyond it requests get 429 with Retry-After. 0 means unbounded.",
    )
    scheduling.add_argument(
        "--seed",
        type=int,
        default=_engine_default("seed"),
        help="Seed for requests that sample without a seed of their own.",
    )
    scheduling.add_argument(
        "--cpu-threads",
        type=int,
        default=_engine_default("cpu_threads"),
        help="CPU: torch threads in the engine process (more helps only on cores nothing else uses).",
    )
    scheduling.add_argument(
        "--debug-checks",
        action=argparse.BooleanOptionalAction,
        default=_engine_default("debug_checks"),
        help="Assert KV-cache page accounting invariants after every change (slow).",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default=ServerSettings.host, help="Address to listen on (0.0.0.0 for all).")
    server.add_argument("--port", type=int, default=ServerSettings.port, help="Port to listen on.")
    server.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer KEY` on /v1/* (default: $FERRY_API_KEY; neither means no key).",
    )
    server.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=ServerSettings.ui,
        help="Serve the built-in chat playground and engine view at / (--no-ui: / answers 404).",
    )
    server.add_argument(
        "--request-timeout",
        type=float,
        default=ServerSettings.request_timeout,
        help="Seconds a request may take from arrival to its last byte before it is aborted (504); 0 disables.",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=ServerSettings.max_request_bytes,
        help="Largest request body accepted (413 beyond).",
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=ServerSettings.drain_timeout,
        help="On SIGTERM, seconds in-flight requests get to finish before the server exits.",
    )
    server.add_argument("--log-level", default=ServerSettings.log_level, choices=LOG_LEVELS, help="Log level.")
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
        return EngineConfig(
            model=str(_model_dir(args)),
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            page_size=args.page_size,
            num_blocks=args.num_blocks,
            max_memory_percent=args.max_memory_percent,
            cpu_kv_cache_gib=args.cpu_kv_cache_gib,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            scheduler_policy=args.scheduler_policy,
            safety_margin=args.safety_margin,
            enable_prefix_caching=args.enable_prefix_caching,
            max_queue_size=args.max_queue_size,
            seed=args.seed,
            attention_backend=args.attention_backend,
            model_impl=args.model_impl,
            cpu_threads=args.cpu_threads,
            debug_checks=args.debug_checks,
        )
    except ValueError as exc:
        args.parser.error(str(exc))


def build_settings(args: argparse.Namespace) -> ServerSettings:
    for flag, value in (("--request-timeout", args.request_timeout), ("--drain-timeout", args.drain_timeout)):
        if value < 0:
            args.parser.error(f"{flag} must be >= 0, got {value}")
    if args.max_request_bytes < 1:
        args.parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    return ServerSettings(
        host=args.host,
        port=args.port,
        # The environment variable keeps the key out of `ps` output and shell history.
        api_key=args.api_key or os.environ.get("FERRY_API_KEY") or None,
        ui=args.ui,
        served_model_name=args.served_model_name,
        request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
    )


def run_serve(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the spawned engine process re-imports this module (multiprocessing's
    # spawn re-imports __main__), and it needs neither the web stack nor the tokenizer libraries.
    import uvicorn

    from server.app import create_app
    from server.lifecycle import FerryServer, Lifecycle

    engine_config = build_engine_config(args)
    settings = build_settings(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry: an OpenAI-compatible LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(subparsers)
    # `ferry bench` lives in the bench package; serving must work without it.
    try:
        from bench.cli import add_bench_parser
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.cli"):
            raise
    else:
        add_bench_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
