"""`ferry bench offline|serve|overhead|tp|decode`: argument parsing and printing; the work lives in the modules.

`add_bench_parser` hangs `bench` under `ferry`'s own subcommands; `python -m bench ...` parses the same
subcommands at the top level. Each subcommand sets `func(args) -> int` (the exit status).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import get_args, get_type_hints

from bench.workload import LengthDist, WorkloadSpec
from engine.config import CompileLevel, ModelConfig

IMAGE_SHAPE_NAMES = ("llava-1.5-7b-v8-t2", "qwen2-vl-2b-v8-t4")
"""bench/images.py's named image architectures (listed here so that parsing needs no torch)."""

ATTENTION_BACKENDS = get_args(get_type_hints(ModelConfig)["attention_backend"])
LENGTH_HELP = "fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA:MAX | pareto:LO:MAX[:ALPHA]"


def _length(spec: str) -> LengthDist:
    try:
        return LengthDist.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _add_workload_args(parser: argparse.ArgumentParser, num_requests: int) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=num_requests)
    group.add_argument("--prompt-len", type=_length, default="uniform:16:256", help=LENGTH_HELP)
    group.add_argument("--output-len", type=_length, default="uniform:16:256", help=LENGTH_HELP)
    group.add_argument("--prefix-len", type=int, default=0, help="tokens shared by every prompt, before its own")
    group.add_argument("--seed", type=int, default=0)


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_requests, args.prompt_len, args.output_len, args.prefix_len, args.seed)


def _emit(report: dict[str, object], text: str, json_path: Path | None) -> None:
    print(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {json_path}")


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _quiet_transformers() -> None:
    # Progress bars and generation-config notices from transformers would bury the table.
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _offline(args: argparse.Namespace) -> int:
    from bench.offline import OfflineOptions, TokenMismatch, format_offline, run_offline

    _set_threads(args.threads)
    _quiet_transformers()
    options = OfflineOptions(
        model=args.model,
        weights=args.weights,
        device=args.device,
        dtype=args.dtype,
        workload=_workload(args),
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        systems=tuple(args.systems.split(",")),
        check="off" if args.no_check else args.check,
        warmup=not args.no_warmup,
        floor=not args.no_floor,
        matmul_floor=args.matmul_floor,
        async_scheduling=args.async_scheduling,
        plot=args.plot,
        repeat=args.repeat,
        profile=args.profile,
        vllm_python=args.vllm_python,
        threads=args.threads,
        compile=args.compile,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
    )
    try:
        report = run_offline(options)
    except TokenMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(
            "no figures reported: the systems must agree before they are compared (--no-check skips this)",
            file=sys.stderr,
        )
        return 1
    _emit(report, format_offline(report), args.json)
    if options.plot is not None:
        print(f"timeline written to {options.plot}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from bench.serve import ServeOptions, format_serve, run_serve

    options = ServeOptions(
        url=args.url,
        model=args.model,
        server=args.server,
        vllm_python=args.vllm_python,
        llama_cpp=args.llama_cpp,
        server_args=tuple(args.server_arg),
        quantization=args.quantization,
        workload=_workload(args),
        vocab_size=args.vocab_size,
        concurrencies=args.concurrency,
        rates=args.request_rate,
        timeout=args.timeout,
        structured_outputs=_structured_outputs(args),
    )
    report = run_serve(options)
    _emit(report, format_serve(report), args.json)
    return 0 if all(p["errors"] == 0 for p in report["points"]) else 1


def _structured_outputs(args: argparse.Namespace) -> dict[str, object] | None:
    """--response-format and --schema as the `structured_outputs` every request sends (None: unconstrained)."""
    if (args.response_format == "json_schema") != (args.schema is not None):
        args.parser.error("--schema FILE goes with --response-format json_schema, and only with it")
    if args.response_format == "json_object":
        return {"json_object": True}
    if args.response_format == "json_schema":
        return {"json": json.loads(args.schema.read_text())}
    return None


def _overhead(args: argparse.Namespace) -> int:
    from bench.overhead import OverheadOptions, format_overhead, run_overhead

    _set_threads(args.threads)
    _quiet_transformers()
    options = OverheadOptions(
        sizes=args.sizes, steps=args.steps, prompt_len=args.prompt_len, page_size=args.page_size, seed=args.seed
    )
    report = run_overhead(options)
    _emit(report, format_overhead(report), args.json)
    return 0


def _tensor_parallel(args: argparse.Namespace) -> int:
    from bench.tensor_parallel import TensorParallelOptions, format_tensor_parallel, run_tensor_parallel

    _quiet_transformers()
    options = TensorParallelOptions(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        sizes=args.sizes,
        steps=args.steps,
        prompt_len=args.prompt_len,
        page_size=args.page_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )
    report = run_tensor_parallel(options)
    _emit(report, format_tensor_parallel(report), args.json)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from bench.decode import DecodeOptions, format_decode, run_decode

    _set_threads(args.threads)
    _quiet_transformers()
    options = DecodeOptions(
        model=args.model,
        sizes=args.sizes,
        context_len=args.context_len,
        steps=args.steps,
        page_size=args.page_size,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        graphs=args.graphs,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        bandwidth_gbs=args.bandwidth_gbs,
        seed=args.seed,
    )
    report = run_decode(options)
    _emit(report, format_decode(report), args.json)
    return 0


def _embed(args: argparse.Namespace) -> int:
    from bench.embed import CosineMismatch, EmbedOptions, format_embed, run_embed

    _quiet_transformers()
    options = EmbedOptions(
        model=args.model,
        num_inputs=args.num_inputs,
        min_len=args.min_len,
        max_len=args.max_len,
        seed=args.seed,
        systems=tuple(v for v in args.systems.split(",") if v),
        dtype=args.dtype,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        max_batch_tokens=args.max_batch_tokens,
        threads=args.threads,
        check_inputs=args.check_inputs,
        min_cosine=args.min_cosine,
        vllm_python=args.vllm_python,
        workdir=args.workdir,
        ferry_args=tuple(args.ferry_arg),
        vllm_args=tuple(args.vllm_arg),
    )
    try:
        report = run_embed(options)
    except CosineMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("no figures reported: the systems' vectors must agree before they are compared", file=sys.stderr)
        return 1
    _emit(report, format_embed(report), args.json)
    return 0


def _graph_modes(text: str) -> tuple[str, ...]:
    modes = tuple(v for v in text.split(",") if v)
    if not modes or any(mode not in ("on", "off") for mode in modes):
        raise argparse.ArgumentTypeError(f"on, off or on,off, got {text!r}")
    return modes


def _quantizations(text: str) -> tuple[str, ...]:
    from typing import get_args

    from engine.config import Quantization

    schemes = tuple(v for v in text.split(",") if v)
    known = get_args(Quantization)
    if not schemes or any(scheme not in known for scheme in schemes):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(known)}; got {text!r}")
    return schemes


def _kv_cache_dtypes(text: str) -> tuple[str, ...]:
    values = tuple(v for v in text.split(",") if v)
    if not values or any(value not in ("auto", "fp8", "fp8_e4m3") for value in values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of auto, fp8; got {text!r}")
    return values


def add_bench_subcommands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(
        dest="bench_command", required=True, metavar="{offline,serve,overhead,tp,decode,perplexity,embed}"
    )

    offline = commands.add_parser(
        "offline",
        help="static batching vs transformers' continuous batching vs Ferry on one workload",
        description="Runs one seeded workload through static batching (waves padded to a common length), "
        "transformers' continuous batching and Ferry; checks greedy tokens agree, then prints wall time, "
        "generated tokens/s, ratios, the model floor and Ferry's efficiency.",
    )
    offline.add_argument(
        "--model",
        default="tiny-llama",
        help="tiny-llama | small-llama | qwen2.5-0.5b | qwen3-0.6b | qwen3-4b | mamba2-reduced | jamba-reduced, or a "
        "local model directory",
    )
    offline.add_argument(
        "--weights",
        choices=("saved", "dummy"),
        default="saved",
        help="named configs: build random weights once and share them (saved), or let each "
        "system draw its own (dummy: faster for big models, no token check)",
    )
    offline.add_argument("--device", default="auto")
    offline.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    _add_workload_args(offline, num_requests=64)
    offline.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="slots: static wave size, transformers' max_requests_per_batch, Ferry's max_num_seqs",
    )
    offline.add_argument(
        "--max-batch-tokens", type=int, default=2048, help="token budget per step (every continuous-batching system)"
    )
    offline.add_argument("--page-size", type=int, default=16, help="Ferry's KV page size")
    offline.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="Ferry's attention kernels (its --attention-backend)",
    )
    offline.add_argument(
        "--systems",
        default="static,transformers-cb,ferry",
        help="comma-separated, run in this order: static, transformers-cb, transformers-cb-default, vllm, "
        "ferry-fallback (Ferry on transformers' modules: --model-impl transformers), ferry",
    )
    offline.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="the python of an environment with vLLM installed (../shared/peers/install-vllm-cpu.sh makes one), "
        "for the vllm system; without it that system is skipped with a note",
    )
    offline.add_argument(
        "--check",
        choices=("strict", "report", "off"),
        default="strict",
        help="greedy token equality: strict fails on any difference, report only records it "
        "(bf16 kernels differ between systems)",
    )
    offline.add_argument("--no-check", action="store_true", help="same as --check off")
    offline.add_argument("--no-warmup", action="store_true", help="skip each system's untimed warm-up run")
    offline.add_argument("--no-floor", action="store_true", help="skip the model-floor replay")
    offline.add_argument(
        "--async-scheduling", action="store_true", help="Ferry plans each step while the one before it runs"
    )
    offline.add_argument("--enforce-eager", action="store_true", help="Ferry without CUDA graphs (its --enforce-eager)")
    offline.add_argument(
        "--quantization",
        default="none",
        choices=("none", "int8", "int8-dynamic", "int4", "fp8"),
        help="Ferry's --quantization (the other systems run the model's dtype)",
    )
    offline.add_argument(
        "--matmul-floor",
        action="store_true",
        help="also time the GEMMs of Ferry's steps alone at the best speed torch reaches, and report the fraction",
    )
    offline.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        help="timed runs per system (and floor replays); the median is reported, each one kept in the JSON",
    )
    offline.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads of every system (default: each system's own)"
    )
    offline.add_argument(
        "--compile",
        choices=get_args(CompileLevel),
        default="none",
        help="Ferry's --compile level (its start-up, compilation included, is reported)",
    )
    offline.add_argument("--json", type=Path, default=None, help="write every figure and per-request trace here")
    offline.add_argument("--plot", type=Path, default=None, help="timeline PNG: static vs continuous batching")
    offline.add_argument(
        "--profile", type=Path, default=None, help="write a torch-profiler op table of one extra (untimed) Ferry run"
    )
    offline.set_defaults(func=_offline)

    serve = commands.add_parser(
        "serve",
        help="streaming load test of an OpenAI-compatible server (vllm bench serve metrics)",
        description="Closed-loop concurrency sweep and open-loop Poisson rates over /v1/completions with "
        "streaming; reports request and token throughput, TTFT, TPOT and ITL at p50/p90/p99.",
    )
    target = serve.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start a server for MODEL on a free local port for the run (see --server)")
    serve.add_argument(
        "--server",
        choices=("ferry", "vllm", "llama.cpp"),
        default="ferry",
        help="the server --model starts: `ferry serve`, `vllm serve` from --vllm-python's environment, or "
        "llama.cpp's `llama-server` from --llama-cpp on a GGUF conversion of the model at its own precision",
    )
    serve.add_argument(
        "--llama-cpp",
        type=Path,
        default=None,
        help="the folder ../shared/peers/install-llama-cpp.sh made, for --server llama.cpp",
    )
    serve.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="the python of an environment with vLLM installed, for --server vllm",
    )
    serve.add_argument(
        "--server-arg", action="append", default=[], help="extra argument for the started server (repeatable)"
    )
    _add_workload_args(serve, num_requests=64)
    serve.add_argument(
        "--quantization",
        default="none",
        choices=("none", "int8", "int8-dynamic", "int4", "fp8"),
        help="the started server's weights: Ferry's --quantization; llama.cpp's Q8_0 for int8, Q4_0 for int4",
    )
    serve.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn below this")
    serve.add_argument("--concurrency", type=_ints, default=(1, 8, 32, 64), help="closed-loop sweep, e.g. 1,8,32,64")
    serve.add_argument(
        "--request-rate", type=_floats, default=(), help="open-loop Poisson rates in requests/s, e.g. 4,16,inf"
    )
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument(
        "--response-format",
        choices=("text", "json_object", "json_schema"),
        default="text",
        help="constrain every request's output (sent as structured_outputs, without ignore_eos)",
    )
    serve.add_argument("--schema", type=Path, default=None, help="JSON Schema file for --response-format json_schema")
    serve.add_argument("--json", type=Path, default=None, help="write summaries and every raw sample here")
    serve.set_defaults(func=_serve, parser=serve)

    overhead = commands.add_parser(
        "overhead",
        help="CPU microseconds per engine step with a zero-cost model",
        description="Runs the real engine step (scheduler, KV-cache manager, runner, sampler, outputs) around a "
        "model that returns zeros, at each number of running sequences, and reports microseconds per step.",
    )
    overhead.add_argument("--sizes", type=_ints, default=(64, 256, 1024), help="running sequences, e.g. 64,256,1024")
    overhead.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    overhead.add_argument("--prompt-len", type=int, default=16)
    overhead.add_argument("--page-size", type=int, default=16)
    overhead.add_argument("--seed", type=int, default=0)
    overhead.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    overhead.add_argument("--json", type=Path, default=None)
    overhead.set_defaults(func=_overhead)

    tp = commands.add_parser(
        "tp",
        help="per-step cost of tensor parallelism: TP=1 against TP=N, and rank 0's time in the collectives",
        description="Runs decode steps of the real engine with random weights at TP=1 and at TP=N for each number "
        "of running sequences, and reports microseconds per step and, on CPU, rank 0's time in the plan "
        "broadcast, the all-reduces and the logits gather.",
    )
    tp.add_argument("--model", default="tiny-llama", help="tiny-llama | small-llama | qwen3-0.6b | qwen3-4b")
    tp.add_argument("--tensor-parallel-size", type=_positive_int, default=2)
    tp.add_argument("--sizes", type=_ints, default=(1, 16, 64), help="running sequences, e.g. 1,16,64")
    tp.add_argument("--steps", type=int, default=100, help="timed decode steps per size")
    tp.add_argument("--prompt-len", type=int, default=16)
    tp.add_argument("--page-size", type=int, default=16)
    tp.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL, a GPU per rank)")
    tp.add_argument("--dtype", default="auto")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--json", type=Path, default=None)
    tp.set_defaults(func=_tensor_parallel)

    decode = commands.add_parser(
        "decode",
        help="decode step time at each batch size against the memory-bandwidth roofline",
        description="Runs decode steps of the real engine with random weights at each batch size (CUDA graphs on "
        "and/or off) and reports milliseconds per step, the bytes of weights and K/V each step reads, and the "
        "fraction of the bandwidth roofline reached.",
    )
    decode.add_argument("--model", default="qwen3-0.6b", help="a named config: tiny-llama, qwen3-0.6b, qwen3-4b, ...")
    decode.add_argument("--sizes", type=_ints, default=(1, 16, 64, 256), help="running sequences, e.g. 1,16,64,256")
    decode.add_argument("--context-len", type=_positive_int, default=512, help="prompt tokens of every sequence")
    decode.add_argument("--steps", type=_positive_int, default=50, help="timed decode steps per size")
    decode.add_argument("--page-size", type=int, default=16)
    decode.add_argument("--device", default="auto")
    decode.add_argument("--dtype", default="auto")
    decode.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    decode.add_argument(
        "--graphs", type=_graph_modes, default=("on",), help="on (the engine's default), off (--enforce-eager), on,off"
    )
    decode.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="memory bandwidth for the roofline (default: H200 on CUDA, a measured copy on CPU)",
    )
    decode.add_argument(
        "--quantization",
        type=_quantizations,
        default=("none",),
        help="--quantization schemes side by side, e.g. none,int8,int4 (none: the model's dtype)",
    )
    decode.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtypes,
        default=("auto",),
        help="--kv-cache-dtype values side by side, e.g. auto,fp8",
    )
    decode.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    decode.add_argument("--seed", type=int, default=0)
    decode.add_argument("--json", type=Path, default=None)
    decode.set_defaults(func=_decode)

    from bench.perplexity import DEMO_HELDOUT, DEMO_MODEL

    perplexity = commands.add_parser(
        "perplexity",
        help="perplexity of held-out text under each --quantization scheme",
        description="Runs a held-out file's conversations through Ferry with prompt logprobs, once per "
        "--quantization scheme, and reports the perplexity of their scored tokens and its ratio to the first scheme.",
    )
    perplexity.add_argument("--model", default=str(DEMO_MODEL), help="a model directory (default: the demo model)")
    perplexity.add_argument(
        "--text", type=Path, default=DEMO_HELDOUT, help="JSONL of {ids, scored} (default: the demo's held-out chats)"
    )
    perplexity.add_argument("--quantization", type=_quantizations, default=("none", "int8", "int4"))
    perplexity.add_argument("--dtype", default="auto")
    perplexity.add_argument("--group-size", type=int, default=128, help="int4 group size")
    perplexity.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    perplexity.add_argument("--json", type=Path, default=None)
    perplexity.set_defaults(func=_perplexity)

    from bench.embed_config import DTYPES, EMBED_SHAPES, EmbedOptions

    embed = commands.add_parser(
        "embed",
        help="embeddings/s: Ferry's server against sentence-transformers' encode and vLLM's pooling runner",
        description="Embeds one seeded set of inputs of mixed length with each system (Ferry's server and vLLM's "
        "over /v1/embeddings with concurrent batched requests, sentence-transformers' encode in-process), checks "
        "their vectors agree with sentence-transformers' in float32 on a few inputs, then prints embeddings/s, "
        "tokens/s and Ferry's ratio to each.",
    )
    embed.add_argument(
        "--model", default="bert-base", choices=tuple(EMBED_SHAPES), help="a named shape, random weights"
    )
    embed.add_argument("--num-inputs", type=_positive_int, default=1024)
    embed.add_argument("--min-len", type=_positive_int, default=16, help="shortest input, special tokens included")
    embed.add_argument("--max-len", type=_positive_int, default=512, help="longest input, special tokens included")
    embed.add_argument("--seed", type=int, default=0)
    embed.add_argument(
        "--systems",
        default="ferry,st,vllm",
        help="comma-separated, run in this order: ferry, st (sentence-transformers), vllm; SYSTEM@DTYPE runs one in "
        "its own dtype, e.g. ferry,st,st@float32,vllm",
    )
    embed.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="every system's dtype; auto: the checkpoint's (BERT float32, Qwen3 bfloat16)",
    )
    embed.add_argument(
        "--batch-size", type=_positive_int, default=32, help="inputs per /v1/embeddings request, and encode's batch"
    )
    embed.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight against a server")
    embed.add_argument(
        "--max-batch-tokens",
        type=_positive_int,
        default=2048,
        help="token budget per engine step: Ferry's --max-batch-tokens, vLLM's --max-num-batched-tokens",
    )
    embed.add_argument(
        "--threads", type=int, default=None, help="CPU threads of every system (default: each system's own)"
    )
    embed.add_argument("--check-inputs", type=_positive_int, default=8, help="inputs whose vectors are compared")
    embed.add_argument("--min-cosine", type=float, default=0.999, help="least cosine to the float32 reference")
    embed.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="the python of an environment with vLLM installed (../shared/peers/install-vllm-cpu.sh makes one), "
        "for the vllm system; without it that system is skipped with a note",
    )
    embed.add_argument(
        "--workdir",
        type=Path,
        default=EmbedOptions.workdir,
        help="where the model directories are built (once per shape and seed) and the servers' logs go",
    )
    embed.add_argument("--ferry-arg", action="append", default=[], help="extra `ferry serve` argument (repeatable)")
    embed.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    embed.add_argument("--json", type=Path, default=None)
    embed.set_defaults(func=_embed)

    spec = commands.add_parser(
        "spec",
        help="speculative decoding against none: repeating, predicted and open chat, at several concurrencies",
        description="Starts two Ferry servers of one model, one with --speculative-config, and alternates every "
        "load point between them for --rounds rounds: repeated questions (answers that repeat their prompt), the "
        "same with OpenAI's prediction set to the earlier answer, and fresh questions. Prints median output "
        "tokens/s, TTFT, ITL and the drafts' acceptance.",
    )
    spec.add_argument(
        "--model", default=str(DEMO_MODEL), help="a model directory or a kept checkpoint's name (default: the demo)"
    )
    spec.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 8}',
        help="the drafting server's --speculative-config",
    )
    spec.add_argument("--concurrency", type=_ints, default=(1, 4, 32), help="closed-loop clients, e.g. 1,4,32")
    spec.add_argument("--rounds", type=_positive_int, default=9, help="alternating rounds per point (medians)")
    spec.add_argument(
        "--num-requests", type=_positive_int, default=64, help="requests per point, at least 8x its concurrency"
    )
    spec.add_argument("--max-tokens", type=_positive_int, default=128)
    spec.add_argument(
        "--draft-pair",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="measure the draft-model path: the demo model widened and deepened by 16 slightly noisy layers "
        "(built once in FOLDER, about 10x its cost per token), drafted for by the demo model",
    )
    spec.add_argument("--json", type=Path, default=None)
    spec.set_defaults(func=_spec)

    images = commands.add_parser(
        "images",
        help="image questions offline: Ferry vs transformers' generate vs vLLM (bench/images.py)",
        description="Requests of one random image and a short question each, greedy with EOS ignored, on a named "
        "image architecture with random weights saved once (identical in every system).",
    )
    images.add_argument("--model", default="llava-1.5-7b-v8-t2", choices=sorted(IMAGE_SHAPE_NAMES))
    images.add_argument("--workdir", type=Path, default=Path("/tmp/ferry-bench-images"))
    images.add_argument("--systems", default="ferry,transformers", help="comma-separated: ferry, transformers, vllm")
    images.add_argument("--num-requests", type=_positive_int, default=32)
    images.add_argument("--image-size", type=_positive_int, default=448, help="pixels on a side of each image")
    images.add_argument("--distinct-images", type=int, default=0, help="images repeated across requests (0: all)")
    images.add_argument("--question-len", type=_positive_int, default=16)
    images.add_argument("--output-len", type=_positive_int, default=64)
    images.add_argument("--max-batch-tokens", type=_positive_int, default=2048)
    images.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    images.add_argument("--seed", type=int, default=0)
    images.add_argument("--threads", type=int, default=None)
    images.add_argument("--vllm-python", type=Path, default=None, help="vLLM's interpreter, for --systems vllm")
    images.add_argument("--json", type=Path, default=None)
    images.set_defaults(func=_images)

    lora = commands.add_parser(
        "lora",
        help="LoRA adapters mixed in (1, 4, 8 of them) against the base model alone, offline and served",
        description="Makes rank-R PEFT adapters of every projection of --model (kept in --workdir), then measures "
        "output tokens/s of the base alone and of 1, 4 and 8 adapters mixed uniformly over the requests, in "
        "rotating order for --rounds rounds: in-process (offline) and through `ferry serve` (closed loop of "
        "--concurrency clients); with --vllm-python, `vllm serve` with the same adapters too. Prints medians and "
        "each mix's ratio to the base within its round.",
    )
    lora.add_argument(
        "--model", default=str(DEMO_MODEL), help="a model directory or a named config (default: the demo model)"
    )
    lora.add_argument("--workdir", type=Path, default=Path("bench-lora"), help="adapters and named models go here")
    lora.add_argument("--adapters", type=_ints, default=(1, 4, 8), help="adapter counts mixed in, e.g. 1,4,8")
    lora.add_argument("--rank", type=_positive_int, default=16)
    lora.add_argument("--concurrency", type=_positive_int, default=32, help="sequences at once (and clients)")
    lora.add_argument("--num-requests", type=_positive_int, default=64, help="requests per run")
    lora.add_argument("--prompt-tokens", type=_positive_int, default=64)
    lora.add_argument("--max-tokens", type=_positive_int, default=128, help="output tokens per request (EOS ignored)")
    lora.add_argument("--rounds", type=_positive_int, default=3)
    lora.add_argument("--mode", action="append", choices=("offline", "serve"), default=None)
    lora.add_argument("--dtype", default="auto")
    lora.add_argument("--vllm-python", type=Path, default=None, help="also serve with vLLM from this environment")
    lora.add_argument("--json", type=Path, default=None)
    lora.set_defaults(func=_lora)


def _lora(args: argparse.Namespace) -> int:
    from bench.lora import LoRABenchOptions, format_lora, run_lora

    _quiet_transformers()
    options = LoRABenchOptions(
        model=args.model,
        workdir=args.workdir,
        adapter_counts=args.adapters,
        rank=args.rank,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.max_tokens,
        rounds=args.rounds,
        modes=tuple(args.mode or ("offline", "serve")),
        dtype=args.dtype,
        vllm_python=args.vllm_python,
    )
    report = run_lora(options)
    _emit(report, format_lora(report), args.json)
    return 0


def _images(args: argparse.Namespace) -> int:
    from bench.images import format_images, run_images

    _set_threads(args.threads)
    _quiet_transformers()
    report = run_images(args)
    _emit(report, format_images(report), args.json)
    return 0


def _spec(args: argparse.Namespace) -> int:
    from bench.spec import SpecOptions, format_spec, run_spec

    options = SpecOptions(
        model=args.model,
        speculative_config=args.speculative_config,
        concurrencies=args.concurrency,
        rounds=args.rounds,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        draft_pair=args.draft_pair,
    )
    report = run_spec(options)
    _emit(report, format_spec(report), args.json)
    return 0


def _perplexity(args: argparse.Namespace) -> int:
    from bench.checkpoints import resolve
    from bench.perplexity import PerplexityOptions, format_perplexity, run_perplexity

    _set_threads(args.threads)
    _quiet_transformers()
    options = PerplexityOptions(
        model=resolve(args.model),
        text=args.text,
        quantization=args.quantization,
        dtype=args.dtype,
        group_size=args.group_size,
    )
    report = run_perplexity(options)
    _emit(report, format_perplexity(report), args.json)
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `bench` under `ferry`'s subcommands; dispatch with `args.func(args)`."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: offline, serve, overhead, tp, decode, perplexity, embed, spec, lora, images",
        description="Reproducible benchmarks of Ferry against its baselines.",
    )
    add_bench_subcommands(bench)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="Ferry benchmarks.")
    add_bench_subcommands(parser)
    args = parser.parse_args(argv)
    return args.func(args)
