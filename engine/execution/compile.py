"""`torch.compile` levels (`EngineConfig.compile`): what each level compiles, which setups refuse a level; the
start-up warm-up (engine/execution/startup.py) compiles every graph a step can need.

- `none`: eager.
- `piecewise`: each decoder layer is one graph (input norm, QKV projection and rotary, attention, output projection
  and residual, post-attention norm, MLP and residual). The layers share it: their weights are its inputs, so it
  compiles once whatever the depth (once per distinct sliding window).
- `full`: the whole decoder in one graph: embedding, every layer, final norm.

In both, paged attention is the opaque op `ferry::layer_attention` (engine/attention/graph_op.py) and oneDNN-packed
linears are `ferry::packed_linear` (engine/layers/linear_method.py); what inductor generates is the rest: norms,
rotary, residuals, activations, fused into C++ loops. The rotary lookup, LM head and sampling stay eager.

The token dimension is dynamic (dynamo's automatic dynamic shapes: a second size makes it symbolic; a one-token
step gets its own graph, since dynamo specializes sizes 0 and 1), so ragged steps do not recompile: the warm-up
runs steps of 1, 2 and 16 tokens at start-up and later steps reuse those graphs. Inductor's output is kept by
torch's FX graph cache (under `TORCHINDUCTOR_CACHE_DIR`), so a restart skips code generation and the C++ compiler;
dynamo still traces.

`fullgraph=True`: whatever dynamo cannot trace fails the start-up instead of running partly eager, and so does
going past the recompile limit (which would otherwise fall back to eager).

Only the native modules on one CPU compile: the transformers adapter's models reach attention through
transformers' own code, a GPU would need its own kernels checked, and tensor-parallel ranks step together, which
a warm-up on one rank would break.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import CompileLevel, EngineConfig, EngineStartupError
from engine.kernels.library import cpu_kernels_available

_RECOMPILE_LIMIT = 16
"""Graphs per compiled function: a one-token and a dynamic graph per sliding window (and the bfloat16 widened
linears' third), with room to spare; past it the start-up fails rather than run eagerly."""


def check_compile_level(config: EngineConfig, *, native: bool, device: torch.device) -> None:
    """Refuse, before anything loads, a level this setup cannot compile (`device`: where the model will run)."""
    level = config.execution.compile
    if level == "none":
        return
    if not native:
        raise EngineStartupError(
            f"--compile {level} compiles the native Llama-family modules only, and this model runs through the "
            "transformers adapter: use --compile none (or --model-impl native, where the model is one of them)"
        )
    if device.type != "cpu":
        raise EngineStartupError(
            f"--compile {level} is built and checked for CPU only (paged attention and the packed linears as "
            f"opaque ops), not {device.type}: use --compile none"
        )
    if config.parallel.tensor_parallel_size > 1:
        raise EngineStartupError(
            f"--compile {level} runs on one device: with --tensor-parallel-size {config.parallel.tensor_parallel_size} "
            "use --compile none"
        )


def compile_model(model: nn.Module, level: CompileLevel) -> None:
    """Wrap the native model's decoder for `level`; nothing compiles until the start-up warm-up runs a step
    (`warm_up`, engine/execution/startup.py)."""
    options = {"fullgraph": True, "recompile_limit": _RECOMPILE_LIMIT}
    if level != "none":
        # A graph takes the kernels' availability as it is when traced. Marked here, not where the function is
        # defined: marking imports torch._dynamo (~1.1 s), which an eager engine never needs.
        torch.compiler.assume_constant_result(cpu_kernels_available)
    if level == "piecewise":
        for layer in model.model.layers:
            layer.compile(**options)
    elif level == "full":
        model.model.compile(**options)
