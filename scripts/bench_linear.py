"""Linear-layer microbenchmark: the CPU linear methods on the same weights, alternating, median microseconds per
call and the weight bandwidth that is (GB/s of weights read once a call: decode's bound).

    python scripts/bench_linear.py --threads 1                       # decode and prefill shapes, float32 and bfloat16
    python scripts/bench_linear.py --rows 1,8 --shapes 1024x3072     # in x out
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"CPU capability {cpu_capability()}, {args.threads} thread(s); us per call (weight GB/s)")
    for dtype in (torch.float32, torch.bfloat16):
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


if __name__ == "__main__":
    main()
