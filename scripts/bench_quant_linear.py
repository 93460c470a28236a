"""Quantized linear microbenchmark: Ferry's quantized kernels (engine/kernels/quant_linear.py) against the blocked
bfloat16 kernel they replace and against torch's own quantized CPU ops, on the same weights; microseconds per call
(best of alternating rounds: the least disturbed by other work on the machine), and each one's speed against bfloat16.

    python scripts/bench_quant_linear.py                                  # Qwen2.5-0.5B's and Llama-3.2-1B's shapes
    python scripts/bench_quant_linear.py --rows 1 --shapes 8192x2048 --threads 2

Shapes are out x in. Each method calls copies of its layer in turn, as many as make about --memory-mib of weights
in all (`--memory-mib 0`: one), so that they come out of DRAM as a model's layers do, not out of a cache. Columns:

- bf16: the blocked bfloat16 kernel (`torch.ops.ferry_kernels.linear`, engine/kernels/linear.pack).
- int8, int4/32, int4/128, w8a8: Ferry's kernels (int4 in groups of 32 and of 128 columns); int8-fma: the int8
  kernel of CPUs without int8 dot products (float32 multiply-adds), where this one has them.
- torch-int8, torch-int4/128: `aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu` (weight-only).
- onednn-w8a8: `onednn.qlinear_pointwise` (AMX where the CPU has it) on the activations quantized per row in torch,
  rescaled after: W8A8 through oneDNN, its quantization and rescale included.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable

import torch

from engine.cpu_isa import cpu_capability
from engine.kernels import quant_linear as ql
from engine.kernels.build import int8_dot_products
from engine.kernels.library import load_cpu_kernels
from engine.kernels.linear import pack

Method = Callable[[torch.Tensor], torch.Tensor]
"""One method's call on x, its layer's weights prepared."""
_FEATURES = ("avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def _cpu() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    return f"{model}, kernels built for {cpu_capability()} ({' '.join(f for f in _FEATURES if f in flags) or '-'})"


def _methods(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, Method]:
    """Each method's call on x, its weights prepared once."""
    out_features, in_features = weight.shape
    blocked = pack(weight.to(dtype))
    w8, w8a8 = ql.quantize_int8(weight), ql.quantize_w8a8(weight)
    w4 = {group: ql.quantize_int4(weight, group) for group in (32, 128) if in_features % group == 0}
    methods: dict[str, Method] = {
        "bf16": lambda x: torch.ops.ferry_kernels.linear(x, blocked, out_features, None),
        "int8": lambda x: ql.int8_linear(x, w8, out_features, None),
    }
    if int8_dot_products():
        w8_fma = ql.quantize_int8(weight, dot_products=False)
        methods["int8-fma"] = lambda x: ql.int8_linear(x, w8_fma, out_features, None)
    for group, w in w4.items():
        methods[f"int4/{group}"] = lambda x, w=w: ql.int4_linear(x, w, out_features, None)
    methods["w8a8"] = lambda x: ql.w8a8_linear(x, w8a8, out_features, None)
    codes8 = ql._codes(w8.codes, out_features, in_features).contiguous()  # [out, in] int8
    methods["torch-int8"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, codes8, w8.scales.to(dtype))
    if 128 in w4 and out_features % 16 == 0:
        codes4 = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32)  # timing only: any codes do
        packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4, 1)
        scale_zeros = torch.rand(in_features // 128, out_features, 2).to(dtype)
        methods["torch-int4/128"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, 128, scale_zeros)
    if torch.backends.mkldnn.is_available():
        codes = ql._codes(w8a8.codes, out_features, in_features).contiguous()
        onednn_weight = torch.ops.onednn.qlinear_prepack(codes, None)
        zero_points = torch.zeros(out_features, dtype=torch.int64)

        def onednn(x: torch.Tensor) -> torch.Tensor:
            q, scale = ql.quantize_activations(x)
            y = torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, onednn_weight, w8a8.scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return (y * scale).to(x.dtype)

        methods["onednn-w8a8"] = onednn
    return methods


def _best_us(layers: list[dict[str, Method]], x: torch.Tensor, seconds: float) -> dict[str, float]:
    """Each method's best time a call over alternating rounds (at least 3, about `seconds` in all), a round calling
    every copy of its layer once."""
    names = list(layers[0])
    for methods in layers:
        for method in methods.values():
            method(x)
    best = dict.fromkeys(names, float("inf"))
    deadline = time.perf_counter() + seconds
    rounds = 0
    while rounds < 3 or time.perf_counter() < deadline:
        for name in names:
            start = time.perf_counter()
            for methods in layers:
                methods[name](x)
            best[name] = min(best[name], (time.perf_counter() - start) / len(layers))
        rounds += 1
    return {name: 1e6 * t for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,8,32,256")
    parser.add_argument("--shapes", default="896x896,4864x896,896x4864,2048x2048,8192x2048", help="out x in")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seconds", type=float, default=0.4, help="per row count and shape")
    parser.add_argument("--memory-mib", type=int, default=768, help="weights of all copies of all methods' layers")
    args = parser.parse_args()
    load_cpu_kernels()
    dtype = getattr(torch, args.dtype)
    print(f"{_cpu()}; x {args.dtype}; us per call (x: speed against bf16)", flush=True)
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            out_features, in_features = map(int, shape.split("x"))
            weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
            # Every method's weights of one layer: bfloat16's, 1 + 1 + 0.6 + 0.5 of int8's, its own three again.
            layer_mib = out_features * in_features * 7 / 2**20
            copies = max(1, round(args.memory_mib / layer_mib))
            layers = [_methods(weight, dtype) for _ in range(copies)]
            for rows in map(int, args.rows.split(",")):
                us = _best_us(layers, torch.randn(rows, in_features).to(dtype), args.seconds)
                cells = [f"bf16 {us['bf16']:7.0f}"]
                cells += [f"{name} {t:7.0f} ({us['bf16'] / t:4.2f}x)" for name, t in us.items() if name != "bf16"]
                print(f"threads {threads} {shape:>9s} rows {rows:3d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
