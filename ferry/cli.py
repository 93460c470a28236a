"""`ferry`, the command line: `ferry serve` runs the OpenAI-compatible server, `ferry bench` the benchmarks.

It joins the two packages' subcommands here, so that neither server/ nor bench/ imports the other. Each
subcommand sets `func(args) -> int` (the exit status); heavy imports wait inside those functions, because
multiprocessing's spawn re-runs this module's imports in the engine process.
"""

from __future__ import annotations

import argparse

from bench.cli import add_bench_parser
from server.cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry: an OpenAI-compatible LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
