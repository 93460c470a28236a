"""Linear-layer microbenchmark: the CPU linear methods on the same weights, alternating, median microseconds per
call and the weight bandwidth that is (GB/s of weights read once a call: decode's bound).

    python scripts/bench_linear.py --threads 1                       # decode and prefill shapes, float32 and bfloat16
    python scripts/bench_linear.py --rows 1,8 --shapes 1024x3072     # in x out
    python scripts/bench_linear.py --threads 2 --dtypes bfloat16 --rows 1,8,32,136 --layers 24 \
        --shapes 1024x1536,1024x1024,1024x5632,2816x1024                # a 280M Llama's decoder, out of cache
    python scripts/bench_linear.py --threads 1 --helper --dtypes float32 --rows 1,32 --layers 4 \
        --shapes 256x384,256x256,256x1536,768x256                       # the demo model's, one thread and its helper

With `--layers N` the shapes are N layers each, distinct tensors walked in order as a model's step walks them
(out of cache: decode's case), and a figure is the median milliseconds of one pass over them all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_isa import cpu_capability
from engine.kernels.library import set_linear_helper
from engine.layers.linear_method import (
    BlockedLinearMethod,
    LinearMethod,
    PackedLinearMethod,
    WidenedLinearMethod,
    onednn_linear_available,
)


def _layer(method: LinearMethod, weight: torch.Tensor) -> nn.Module:
    layer = nn.Module()
    layer.output_size, layer.input_size = weight.shape
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    method.process_weights_after_loading(layer)
    return layer


def _call(method: LinearMethod | None, layer: nn.Module | None, weight: torch.Tensor, x: torch.Tensor) -> Callable:
    if method is None:
        return lambda: F.linear(x, weight)
    return lambda: method.apply(layer, x, None)


def _median_us(call: Callable[[], object], seconds: float) -> float:
    call()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--shapes", default="256x768,1024x3072,3072x1024,256x4096")
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=1, help="distinct layers of each shape, timed as one pass")
    parser.add_argument(
        "--helper", action="store_true", help="with --layers: the blocked kernel with its helper thread too"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"CPU capability {cpu_capability()}, {args.threads} thread(s); us per call (weight GB/s)")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    if args.layers > 1:
        _model_passes(args, dtypes)
        return
    for dtype in dtypes:
        methods: dict[str, LinearMethod | None] = {"blocked": BlockedLinearMethod(), "torch": None}
        if onednn_linear_available(cpu, dtype):
            methods["onednn"] = PackedLinearMethod()
        if dtype == torch.bfloat16:
            methods["widened"] = WidenedLinearMethod()
        for shape in args.shapes.split(","):
            in_features, out_features = map(int, shape.split("x"))
            weight = torch.randn(out_features, in_features).to(dtype)
            layers = {name: _layer(m, weight) if m is not None else None for name, m in methods.items()}
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, in_features).to(dtype)
                cells = []
                for name, method in methods.items():
                    us = _median_us(_call(method, layers[name], weight, x), args.seconds)
                    cells.append(f"{name} {us:8.0f} ({weight.numel() * weight.element_size() / us / 1e3:5.1f})")
                print(f"{str(dtype)[6:]:8s} {in_features:5d}x{out_features:<5d} rows {rows:4d}  " + "  ".join(cells))


def _model_passes(args: argparse.Namespace, dtypes: list[torch.dtype]) -> None:
    """`--layers`: one pass over every layer of every shape, per method and row count, the methods alternating."""
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")] * args.layers
    for dtype in dtypes:
        methods: dict[str, LinearMethod] = {"blocked": BlockedLinearMethod()}
        if onednn_linear_available(torch.device("cpu"), dtype):
            methods["onednn"] = PackedLinearMethod()
        layers = {
            name: [_layer(method, torch.randn(out, in_).to(dtype)) for in_, out in shapes]
            for name, method in methods.items()
        }
        if args.helper:  # the blocked layers again, their blocks shared with the helper thread (engine/kernels/)
            methods["helper"], layers["helper"] = methods["blocked"], layers["blocked"]
        weight_bytes = sum(in_ * out for in_, out in shapes) * dtype.itemsize
        for rows in map(int, args.rows.split(",")):
            xs = {in_: torch.randn(rows, in_).to(dtype) for in_, _ in shapes}
            times: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(7):
                for name, method in methods.items():
                    set_linear_helper(name == "helper")
                    start = time.perf_counter()
                    for layer in layers[name]:
                        method.apply(layer, xs[layer.input_size], None)
                    times[name].append(time.perf_counter() - start)
            set_linear_helper(False)
            cells = [
                f"{name} {1e3 * statistics.median(t):7.2f} ms ({weight_bytes / statistics.median(t) / 1e9:5.1f} GB/s)"
                for name, t in times.items()
            ]
            print(f"{str(dtype)[6:]:8s} {len(shapes)} layers rows {rows:4d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
