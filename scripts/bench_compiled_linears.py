"""Ferry's oneDNN-packed linears (eager) against torch's own: `F.linear` (MKL) and inductor's compiled linears.

Inductor is given what it needs to pack weights itself (`freezing`: parameters become constants), once with a
dynamic row count (what a compiled engine step has) and once specialized to it. Weight shapes are Qwen2.5-0.5B's
(and the demo model's LM head); thread CPU time, median of 15 calls after 3 untimed ones, one torch thread.

    python scripts/bench_compiled_linears.py
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.layers.linear_method import PackedLinearMethod

SHAPES = {
    "qkv": (896, 1152),
    "o_proj": (896, 896),
    "gate_up": (896, 9728),
    "down": (4864, 896),
    "demo_head": (256, 4096),
}
ROWS = (1, 8, 64, 256)


def _seconds(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    for _ in range(3):
        run(x)
    times = []
    for _ in range(15):
        started = time.thread_time()
        run(x)
        times.append(time.thread_time() - started)
    return statistics.median(times)


def _compiled(layer: nn.Linear, x: torch.Tensor, dynamic: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    compiled = torch.compile(layer, options={"freezing": True}, dynamic=False)
    if dynamic and x.shape[0] > 1:
        torch._dynamo.mark_dynamic(x, 0)
    return compiled


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'weight':10} {'rows':>4} {'packed':>8} {'F.linear':>8} {'dynamic':>8} {'static':>8}   ms")
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            layer = nn.Linear(k, n).eval()
            packed = ReplicatedLinear.adopt(layer, PackedLinearMethod())  # `layer` itself stays unpacked
            for rows in ROWS:
                x = torch.randn(rows, k)
                times = [
                    _seconds(packed, x),
                    _seconds(functools.partial(F.linear, weight=layer.weight, bias=layer.bias), x),
                ]
                for dynamic in (True, False):
                    torch._dynamo.reset()
                    marked = x.clone()
                    times.append(_seconds(_compiled(layer, marked, dynamic), marked))
                print(f"{name:10} {rows:4d} " + " ".join(f"{t * 1e3:8.3f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
