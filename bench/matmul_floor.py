"""The matmul floor: only the GEMMs of Ferry's own steps, each at the best speed torch reaches on this machine.

For a matmul-bound model the question is how close a step comes to its matrix multiplies alone. Every linear of
the loaded model is run at the row count it had in each recorded step (the step's tokens; the sampled rows for the
LM head), and for each layer shape the faster of two implementations is kept: the model's own layer (oneDNN-packed,
widened bfloat16 or torch's default, whatever the loader chose) and `F.linear` over a plain weight of the same
shape (MKL or oneDNN through torch's default dispatch). Each shape runs over as many distinct weights as the model
has layers of it, in turn, so the weights stream from memory as they do in a forward pass. Steps with the same row
count share one measurement. Nothing else of the step is run: no attention, norms, rotary, sampling or scheduling.

matmul floor / Ferry's wall time is the fraction of the floor Ferry reaches (1.0: its steps are GEMMs only).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bench.ferry import StepShape
from engine.layers.linear import LinearBase

if TYPE_CHECKING:
    from engine import EngineCore

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass
class MatmulFloor:
    seconds: float
    flops: float
    shapes: dict[str, str]
    """Per layer shape (`in x out, layers`): the implementation that was faster at most row counts."""

    def summary(self) -> dict[str, object]:
        return {"seconds": self.seconds, "gflop": self.flops / 1e9, "implementations": self.shapes}


@dataclass
class _Shape:
    in_features: int
    out_features: int
    head: bool
    layers: list[nn.Module]

    @property
    def label(self) -> str:
        return f"{self.in_features}x{self.out_features}{' (lm_head)' if self.head else ''}, {len(self.layers)} layers"


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a module that is one linear layer, else None."""
    if isinstance(module, LinearBase):  # Ferry's layers (native models, and adopted transformers linears)
        return module.input_size, module.output_size
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if hasattr(module, "in_features") and hasattr(module, "out_features") and not list(module.children()):
        return int(module.in_features), int(module.out_features)
    return None


def _shapes(model: nn.Module) -> list[_Shape]:
    by_key: dict[tuple[int, int, bool], _Shape] = {}
    for name, module in model.named_modules():
        features = _features(module)
        if features is None:
            continue
        head = name.rsplit(".", 1)[-1] == "lm_head"
        key = (*features, head)
        by_key.setdefault(key, _Shape(*features, head, [])).layers.append(module)
    return list(by_key.values())


def _timed(run, sync) -> float:
    sync()
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def measure_matmul_floor(engine: EngineCore, shapes: list[StepShape]) -> MatmulFloor:
    """The floor of `shapes` (the steps of one Ferry run) on `engine`'s loaded model."""
    hf_config = engine.hf_config
    if any(getattr(hf_config, key, None) for key in _EXPERT_KEYS):
        raise ValueError("the matmul floor is for dense models: MoE experts each see a routed share of the rows")
    model = engine.runner.model
    device = engine.device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    layer_shapes = _shapes(model)
    body_rows = Counter(s.total_tokens for s in shapes)
    head_rows = Counter(sum(s.sampling) for s in shapes if any(s.sampling))
    seconds = flops = 0.0
    wins: dict[str, Counter[str]] = {}
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for shape in layer_shapes:
            plain = [
                torch.randn(shape.out_features, shape.in_features, device=device, dtype=dtype, generator=generator)
                for _ in shape.layers
            ]
            tally = wins.setdefault(shape.label, Counter())
            rows_seen = head_rows if shape.head else body_rows
            for rows, steps in sorted(rows_seen.items()):
                x = torch.randn(rows, shape.in_features, device=device, dtype=dtype, generator=generator)
                candidates = {
                    "model's layer": lambda x=x, shape=shape: [layer(x) for layer in shape.layers],
                    "F.linear": lambda x=x, plain=plain: [F.linear(x, w) for w in plain],
                }
                times = {}
                for label, run in candidates.items():
                    run()  # the first call at a row count may pick or build a kernel
                    times[label] = _timed(run, sync)
                best = min(times, key=times.__getitem__)
                tally[best] += steps
                seconds += steps * times[best]
                flops += steps * 2.0 * rows * shape.in_features * shape.out_features * len(shape.layers)
            del plain
    return MatmulFloor(seconds, flops, {label: tally.most_common(1)[0][0] for label, tally in wins.items() if tally})
