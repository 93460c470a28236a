"""Linear layers that load their own weights and slice them for tensor parallelism, Megatron-style.

Each layer holds this rank's part (`Shard`: rank and number of ranks) and a `LinearMethod` (the weight layout and
arithmetic: engine/layers/linear_method.py). Checkpoint tensors arrive whole through `weight_loader(name, tensor,
shard_id)`, and the layer copies the slice its rank holds; once its last shard is in, the method processes the
weights (oneDNN packs them there), so packing goes layer by layer as the checkpoint streams in.

- `ReplicatedLinear`: the whole matrix on every rank.
- `ColumnParallelLinear`: this rank's rows of the output (`[out/size, in]`).
- `MergedColumnParallelLinear`: several column-parallel matrices side by side (gate and up), shard ids 0, 1, ...
- `QKVParallelLinear`: q, k and v (shard ids "q", "k", "v") of this rank's heads; with fewer KV heads than ranks
  each KV head is replicated on the ranks whose query heads read it.
- `RowParallelLinear`: this rank's columns of the input (`[out, in/size]`), partial sums all-reduced; the bias
  is added once (rank 0 holds it, the other ranks zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.context import step_lora
from engine.layers.linear_method import LinearMethod, UnquantizedLinearMethod
from engine.lora.batch import LoRABatch

if TYPE_CHECKING:
    from transformers.pytorch_utils import Conv1D

ShardId = int | str | None
"""Which part of a fused layer a checkpoint tensor is (None for an unfused layer)."""


@dataclass(frozen=True)
class Shard:
    """This process's place among the tensor-parallel ranks: what part of each layer it holds."""

    rank: int = 0
    size: int = 1


ONE_RANK = Shard()
"""No tensor parallelism: every layer whole."""


class AdapterSlots(Protocol):
    """A layer's LoRA adapter slots (engine/lora/slots.py's `LoRALayer`)."""

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """out += the low-rank products of x of the step's tokens' adapters."""

    def add_in_graph(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`add` inside a compiled graph, which reads the step's batch as it runs."""


def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} {total} does not divide by {size} tensor-parallel ranks")
    return total // size


class LinearBase(nn.Module):
    """`x @ weight.T + bias` through `method`, on this rank's `[output_size, input_size]` part."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
        shard_ids: tuple[ShardId, ...] = (None,),
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.shard = shard
        self.method = method
        method.create_weights(self, input_size, output_size, bias, dtype or torch.get_default_dtype())
        needed, self._optional = method.checkpoint_names(bias)
        self._pending = {(name, part) for part in shard_ids for name in needed}
        """The (checkpoint tensor, shard id) pieces not loaded yet: the method processes the weights when none is
        left."""
        self._inputs_loaded: set[str] = set()
        self.lora: AdapterSlots | None = None
        """Its LoRA adapter slots (engine/lora/), with --enable-lora on an adapted projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_adapters(x, self.method.apply(self, x, self.bias))

    def _with_adapters(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus the step's LoRA products of `x`, for a layer with adapter slots in a step with adapters."""
        if self.lora is None:
            return out
        if torch.compiler.is_compiling():
            self.lora.add_in_graph(x, out)
        elif (batch := step_lora()) is not None:
            self.lora.add(x, out, batch)
        return out

    def part_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(first row, rows) of part `shard_id` in this rank's output."""
        return 0, self.output_size

    def lora_factors(self, a: torch.Tensor, b: torch.Tensor, shard_id: ShardId) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair of part `shard_id` (A `[r, in]`, B `[out, r]`, whole), sharded as the
        weight is: a column-parallel layer keeps A whole and its rows of B (per sub-matrix of a fused layer); a
        row-parallel one its columns of A and B whole, the ranks' partial products summed by its all-reduce."""
        rows = torch.empty(self.output_size, b.shape[1], device="meta")
        return a, self._placement("weight", rows, b, shard_id)[1]

    @torch.no_grad()
    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` (`name`, one of the method's `checkpoint_names`:
        "weight" or "bias", or a quantized checkpoint's; `shard_id` for a part of a fused layer) into place; the last
        needed piece hands the weights to the method."""
        pending = (name, shard_id) in self._pending
        if not pending and name not in self._optional:
            raise ValueError(f"{type(self).__name__} has no pending {name!r} of shard {shard_id!r}")
        # A quantizing method turns the whole checkpoint tensor into its parameters (codes, scales) before any
        # slicing, so each rank keeps its slice of what one rank would hold: the same scales at every TP size.
        for param_name, tensor in self.method.checkpoint_tensors(name, loaded):
            param = getattr(self, param_name)
            if param_name in self.method.input_parameters:
                self._load_input_vector(param_name, param, tensor)
                continue
            if tensor.numel() == 1 and param.dim() == 1 and param_name != "bias":
                first, rows = self.part_rows(shard_id)  # a per-tensor scale: the same for each row of its part
                param[first : first + rows] = tensor
                continue
            target, source = self._placement(param_name, param, tensor, shard_id)
            target.copy_(source)
            del target, source  # a slice may be a copy (a row-parallel bias): not kept while the method repacks
        self._pending.discard((name, shard_id))
        if pending and not self._pending:  # an optional tensor (one that adds nothing) may come after the last
            self.method.process_weights_after_loading(self)

    def _load_input_vector(self, name: str, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Parameter `name`, one value per input, whole: a fused layer's parts read the same inputs, so each part's
        must be the same (GPTQ's activation order follows the inputs' statistics, which the parts share). Only one
        rank holds such a parameter: activation order over tensor parallelism is refused
        (engine/quantization/checkpoints.py)."""
        if name in self._inputs_loaded and not torch.equal(param, loaded.to(param.dtype)):
            raise ValueError(f"the parts of a fused {type(self).__name__} differ in their {name}")
        param.copy_(loaded)
        self._inputs_loaded.add(name)

    def finish_loading(self) -> None:
        """Weights were written in place (dummy weights): process them as if each shard had been loaded."""
        self._pending.clear()
        self.method.process_weights_after_loading(self)

    @property
    def loaded(self) -> bool:
        return not self._pending

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(where in parameter `name`, `param`, what of `loaded`) this rank keeps; a replicated layer keeps all of it.
        Every parameter's first dimension is the output (weights, biases, a quantized weight's scales)."""
        return param, loaded

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"method={type(self.method).__name__}, rank={self.shard.rank}/{self.shard.size}"
        )


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank."""

    @classmethod
    def adopt(cls, module: nn.Linear | Conv1D, method: LinearMethod) -> ReplicatedLinear:
        """A Ferry layer computing what transformers' `module` does through `method`, its weights taken over
        (the same parameter for a plain-layout method on an `nn.Linear`: a tied matrix stays shared)."""
        weight = module.weight if type(module) is nn.Linear else module.weight.t()  # Conv1D stores `[in, out]`
        out_features, in_features = weight.shape
        with torch.device("meta"):
            layer = cls(in_features, out_features, bias=module.bias is not None, method=method, dtype=weight.dtype)
        if method.plain_layout and type(module) is nn.Linear:
            layer.weight = module.weight
        else:
            # Conv1D's weight made contiguous once, so each row is a plain block (and oneDNN reads `[out, in]`).
            layer.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        layer.bias = module.bias
        layer.finish_loading()
        return layer


class ColumnParallelLinear(LinearBase):
    """This rank's `output_size / size` rows of the output (`output_size`: the whole layer's)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
    ) -> None:
        super().__init__(
            input_size, _divide(output_size, shard.size, "output size"), bias=bias, method=method, dtype=dtype,
            shard=shard,
        )  # fmt: skip

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = param.shape[0]
        return param, loaded.narrow(0, self.shard.rank * rows, rows)


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel matrices of `output_sizes` side by side (gate and up: shard ids 0 and 1), each split
    over the ranks: this rank's part of each, in order."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
    ) -> None:
        self.part_sizes = [_divide(size, shard.size, "output size") for size in output_sizes]
        super().__init__(
            input_size, sum(self.part_sizes), bias=bias, method=method, dtype=dtype, shard=shard,
            shard_ids=tuple(range(len(output_sizes))),
        )  # fmt: skip

    def part_rows(self, shard_id: ShardId) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        return sum(self.part_sizes[:shard_id]), self.part_sizes[shard_id]

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(shard_id, int)
        size = self.part_sizes[shard_id]
        return param.narrow(0, sum(self.part_sizes[:shard_id]), size), loaded.narrow(0, self.shard.rank * size, size)


class QKVParallelLinear(LinearBase):
    """q, k and v of this rank's heads side by side (shard ids "q", "k", "v"): `num_heads / size` query heads and
    `num_kv_heads / size` KV heads, or, with fewer KV heads than ranks, the one KV head its query heads read."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
    ) -> None:
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = _divide(num_heads, shard.size, "attention heads")
        if num_kv_heads % shard.size and shard.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither divide by nor divide {shard.size} ranks")
        self.num_kv_heads = max(1, num_kv_heads // shard.size)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(
            hidden_size, self.q_size + 2 * self.kv_size, bias=bias, method=method, dtype=dtype, shard=shard,
            shard_ids=("q", "k", "v"),
        )  # fmt: skip

    def part_rows(self, shard_id: ShardId) -> tuple[int, int]:
        if shard_id == "q":
            return 0, self.q_size
        return (self.q_size if shard_id == "k" else self.q_size + self.kv_size), self.kv_size

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if shard_id == "q":
            return param.narrow(0, 0, self.q_size), loaded.narrow(0, self.shard.rank * self.q_size, self.q_size)
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        first_head = self.shard.rank * self.total_kv_heads // self.shard.size
        return param.narrow(0, offset, self.kv_size), loaded.narrow(0, first_head * self.head_dim, self.kv_size)


class RowParallelLinear(LinearBase):
    """This rank's `input_size / size` columns of the input; `all_reduce` (the group's, None on one rank) sums
    the ranks' partial products. The bias is added once: rank 0 holds it, the other ranks zeros."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(
            _divide(input_size, shard.size, "input size"), output_size, bias=bias, method=method, dtype=dtype,
            shard=shard,
        )  # fmt: skip
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The LoRA products join the partial sums before the all-reduce: one reduction adds both up.
        out = self._with_adapters(x, self.method.apply(self, x, self.bias))
        return out if self.all_reduce is None else self.all_reduce(out)

    def lora_factors(self, a: torch.Tensor, b: torch.Tensor, shard_id: ShardId) -> tuple[torch.Tensor, torch.Tensor]:
        columns = torch.empty(a.shape[0], self.input_size, device="meta")
        return self._placement("weight", columns, a, shard_id)[1], b

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if name == "bias":
            return param, loaded if self.shard.rank == 0 else torch.zeros_like(loaded)
        if loaded.dim() == 1:  # a scale per output channel: every rank's columns share it
            return param, loaded
        # The weight, or a quantized weight's groups of columns (scales, zero points): this rank's columns.
        columns = param.shape[1]
        return param, loaded.narrow(1, self.shard.rank * columns, columns)


def adopt_linears(model: nn.Module, method: LinearMethod) -> int:
    """Replace every `nn.Linear` and GPT-2 `Conv1D` inside transformers' `model` with a `ReplicatedLinear` on
    `method` (a matrix another module shares, a tied LM head's, on the plain-layout `UnquantizedLinearMethod` when
    `method` would repack it); returns how many. The one place the transformers fallback's linears change."""
    from transformers.pytorch_utils import Conv1D

    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, Conv1D)
    ]
    for parent, name, child in swaps:
        shared = uses[id(child.weight)] > 1
        chosen = UnquantizedLinearMethod() if shared and not method.plain_layout else method
        setattr(parent, name, ReplicatedLinear.adopt(child, chosen))
    return len(swaps)


class PatchLinear(nn.Module):
    """A convolution whose kernel is its stride, over inputs of exactly one kernel each (Qwen2-VL's patch
    embedding: `[patches, C, T, P, P]` in, `[patches, out, 1, 1, 1]` out), computed as the matmul it is: oneDNN's
    3-D convolution takes ~5x longer in bfloat16 on a CPU. `weight` is the convolution's, flattened `[out, in]`."""

    def __init__(self, conv: nn.Conv3d) -> None:
        super().__init__()
        self.kernel_size = tuple(conv.kernel_size)
        self.out_channels = conv.out_channels
        flat = conv.weight.detach().reshape(conv.out_channels, -1).contiguous()
        self.weight = nn.Parameter(flat, requires_grad=False)
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.kernel_size:
            raise ValueError(f"a patch embedding of kernel {self.kernel_size} was given inputs {list(x.shape)}")
        out = F.linear(x.reshape(x.shape[0], -1), self.weight, self.bias)  # [patches, out]
        return out.view(x.shape[0], self.out_channels, 1, 1, 1)

    @staticmethod
    def adopts(module: nn.Module) -> bool:
        """Whether `module` is such a convolution (no padding, dilation or groups)."""
        return (
            type(module) is nn.Conv3d
            and tuple(module.kernel_size) == tuple(module.stride)
            and all(p == 0 for p in module.padding)  # type: ignore[union-attr]
            and all(d == 1 for d in module.dilation)
            and module.groups == 1
        )
