"""Per-layer attention microbenchmark: one backend `forward` (K/V write included) over a packed step of decodes,
optionally with prefill chunks, on shuffled pages; median microseconds per call for each backend, alternating.
Wall time and the process's CPU time are both reported: on a shared machine the CPU time is the steadier figure
(it leaves out the time other processes hold the core), and with one thread it is the cost of the call.

    python scripts/bench_attention.py --batch 64 --heads 8 --kv-heads 2 --head-dim 32   # the demo model's shape
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.attention import StepMetadata, TorchPagedBackend
from engine.attention.base import AttentionBackend
from engine.attention.cpu_kernel import load_kernel
from engine.attention.cpu_paged import CpuPagedBackend


def step(context: list[int], chunks: list[int], page_size: int, rng: np.random.Generator) -> tuple[StepMetadata, int]:
    """Decodes over `context` cached tokens each, then chunks of `chunks` new tokens with no history; shuffled
    pages. Returns the metadata and the number of pages it uses."""
    query_lens = [1] * len(context) + chunks
    seq_lens = [c + 1 for c in context] + chunks
    pages_of = [-(-n // page_size) for n in seq_lens]
    order = rng.permutation(sum(pages_of)).astype(np.int32)
    width = max(pages_of)
    tables = np.zeros((len(seq_lens), width), dtype=np.int32)
    slots, positions, start = [], [], 0
    for i, (n, total, pages) in enumerate(zip(query_lens, seq_lens, pages_of, strict=True)):
        tables[i, :pages] = order[start : start + pages]
        start += pages
        for pos in range(total - n, total):
            positions.append(pos)
            slots.append(int(tables[i, pos // page_size]) * page_size + pos % page_size)
    cu_q = np.concatenate([[0], np.cumsum(query_lens)])
    meta = StepMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(cu_q, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_tables=torch.from_numpy(tables),
        page_tables_host=tables,
        query_start_loc_host=cu_q.tolist(),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        page_size=page_size,
    )
    return meta, sum(pages_of)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences")
    parser.add_argument("--context", type=str, default="16:512", help="cached tokens per decode, uniform MIN:MAX")
    parser.add_argument("--chunks", type=str, default="", help="comma-separated prefill chunk lengths, e.g. 256,128")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=4, help="distinct KV caches the calls cycle through, as a model's layers do"
    )
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per backend and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing every backend once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(args.seed)
    low, high = (int(x) for x in args.context.split(":"))
    context = rng.integers(low, high + 1, size=args.batch).tolist()
    chunks = [int(x) for x in args.chunks.split(",") if x]
    meta, num_pages = step(context, chunks, args.page_size, rng)
    tokens = len(meta.positions)
    shape = (num_pages, args.page_size, args.kv_heads, args.head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
    query = torch.randn(tokens, args.heads, args.head_dim).to(dtype)
    key = torch.randn(tokens, args.kv_heads, args.head_dim).to(dtype)
    value = torch.randn(tokens, args.kv_heads, args.head_dim).to(dtype)
    scale = args.head_dim**-0.5

    backends: list[AttentionBackend] = [TorchPagedBackend(), CpuPagedBackend(load_kernel())]
    for backend in backends:
        backend.prepare(meta)
    reference = backends[0].forward(query, key, value, caches[0], meta, scale, args.window)
    for backend in backends[1:]:
        got = backend.forward(query, key, value, caches[0], meta, scale, args.window)
        print(f"{backend.name}: max |difference| from torch {(got.float() - reference.float()).abs().max().item():.2e}")

    wall: dict[str, list[float]] = {b.name: [] for b in backends}
    cpu: dict[str, list[float]] = {b.name: [] for b in backends}
    for _ in range(args.rounds):
        for backend in backends:
            started, started_cpu = time.perf_counter(), time.process_time()
            for call in range(args.calls):
                backend.forward(query, key, value, caches[call % args.layers], meta, scale, args.window)
            wall[backend.name].append((time.perf_counter() - started) / args.calls * 1e6)
            cpu[backend.name].append((time.process_time() - started_cpu) / args.calls * 1e6)
    print(
        f"batch {args.batch} decodes (context {args.context}), chunks {chunks or 'none'}, H {args.heads} / Hkv "
        f"{args.kv_heads}, D {args.head_dim}, page {args.page_size}, {args.dtype}, {args.layers} layers, "
        f"{args.threads} thread(s)"
    )
    print(f"  medians of {args.rounds} rounds of {args.calls} calls, us per call")
    for name in wall:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        w0, c0 = statistics.median(wall[backends[0].name]), statistics.median(cpu[backends[0].name])
        print(f"  {name:6s} wall {w:9.1f} ({w0 / w:5.2f}x torch)   cpu {c:9.1f} ({c0 / c:5.2f}x torch)")


if __name__ == "__main__":
    main()
