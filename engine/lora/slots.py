"""Adapter weights in preallocated slots on each adapted linear layer, and one step's low-rank products over them.

Each adapted layer (`LoRALayer`, attached as `layer.lora`) holds, per part of its output (q, k and v of a fused QKV
layer; gate and up; one part otherwise), `max_loras` slots of rank `slot_rank(max_lora_rank)` side by side:

    a_t: [slots, in, rank]         the slots' A matrices, each transposed
    bt:  [slots * rank, out_part]  their B matrices, transposed, stacked (rows j*rank ... of slot j)

An adapter of a smaller rank fills the first ranks of its slot and zeros the rest; a part an adapter leaves alone is
all zeros in its slot. The tensors never change shape, so a step with adapters runs the same code whichever are
loaded.

A step's `LoRABatch` gives each token's slot (-1: the base model). On the CPU one kernel call per part
(engine/kernels/cpu_lora.cpp) computes Punica's shrink and expand for each token against its own slot only:

    out[t, part] += scaling[s] * (x[t] @ a[s].T) @ bt[s]      for s = slots[t]

Elsewhere (CUDA, float16) torch's matmuls do it for all tokens at once, each against every slot in use (`k`: the
slots are handed out lowest first), the other slots' products masked out (`LoRABatch.mask`, `[T, k * rank]`: the
token's scaling in its slot's columns, zeros elsewhere):

    s = x @ a_t[:k]              # [k, T, rank], as [T, k * rank]
    s *= mask
    out[:, part] += s @ bt[: k * rank]

A step with no adapter has no batch (`LoRABatch` None) and the layers skip all of it.

Under `torch.compile` (engine/execution/compile.py) a layer's products are the opaque op `ferry::lora_add`, which
reads the step's batch from the step context itself, as `ferry::layer_attention` reads its metadata: a compiled
layer cannot branch on the step's adapters, so it calls the op in every step, and without adapters the op returns
at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.context import step_lora
from engine.kernels.library import cpu_kernels_take
from engine.layers.linear import LinearBase, ShardId
from engine.lora.batch import LoRABatch


@dataclass
class _Part:
    """One output part of an adapted layer: its rows of the output and its slots."""

    offset: int
    size: int
    a_t: torch.Tensor  # [slots, in, rank]
    bt: torch.Tensor  # [slots * rank, size]


PartSlots = tuple[torch.Tensor, torch.Tensor, int]
"""One part's slots and place in the output: (a_t `[slots, in, rank]`, bt `[slots * rank, size]`, first row)."""


def _add_in_step(
    out: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], offsets: list[int], rank: int
) -> None:
    """`ferry::lora_add`: out += the step's adapter products of x over the parts whose slots are `weights` (a_t, bt
    of each part in turn) at output `offsets`."""
    batch = step_lora()
    if batch is not None:
        _add_parts(x, out, list(zip(weights[::2], weights[1::2], offsets, strict=True)), rank, batch)


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
_LIBRARY.define("lora_add(Tensor(a!) out, Tensor x, Tensor[] weights, int[] offsets, int rank) -> ()")
_LIBRARY.impl("lora_add", _add_in_step, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::lora_add", lib=_LIBRARY)
def _(out: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], offsets: list[int], rank: int) -> None:
    return None


def _add_parts(
    x: torch.Tensor,
    out: torch.Tensor,
    parts: list[PartSlots],
    rank: int,
    batch: LoRABatch,
    per_token: bool | None = None,
) -> None:
    """out[:, part] += each token's product of every part. `per_token`: on the CPU kernel, each token against its
    own slot; else torch's matmuls, every token against every slot in use, the others' products masked out (None:
    the kernel wherever it takes x)."""
    if cpu_kernels_take(x) if per_token is None else per_token:
        rows = x if x.stride(-1) == 1 else x.contiguous()
        for a_t, bt, offset in parts:
            torch.ops.ferry_kernels.lora_add(out, rows, a_t, bt, batch.slots, batch.scalings, offset, rank)
        return
    columns = batch.num_slots * rank
    for a_t, bt, offset in parts:
        shrunk = torch.matmul(x, a_t[: batch.num_slots]).transpose(0, 1).reshape(x.shape[0], columns)  # [T, columns]
        shrunk.mul_(batch.mask)
        out.narrow(-1, offset, bt.shape[1]).addmm_(shrunk, bt[:columns])


def slot_rank(max_lora_rank: int) -> int:
    """The rank of every slot: --max-lora-rank rounded up to a multiple of 8, the CPU kernel's unit (its shrink keeps
    8 or 16 ranks of a token in one vector register; the padding ranks are zeros)."""
    return -(-max_lora_rank // 8) * 8


class LoRALayer:
    """The adapter slots of one linear layer: `add` puts the step's low-rank products into its output."""

    def __init__(
        self,
        layer: LinearBase,
        parts: list[ShardId],
        num_slots: int,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """Slots for the `parts` (shard ids) of `layer` that adapters may adapt; `dtype`: the activations'."""
        self.layer = layer
        self.rank = rank
        self.parts: dict[ShardId, _Part] = {}
        for shard_id in parts:
            offset, size = layer.part_rows(shard_id)
            self.parts[shard_id] = _Part(
                offset,
                size,
                torch.zeros(num_slots, layer.input_size, rank, device=device, dtype=dtype),
                torch.zeros(num_slots * rank, size, device=device, dtype=dtype),
            )
        self._part_slots: list[PartSlots] = [(part.a_t, part.bt, part.offset) for part in self.parts.values()]
        """What `add` reads of each part (the tensors stay the same objects: `load` writes into them)."""

    @torch.no_grad()
    def load(self, slot: int, pairs: dict[ShardId, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A `[r, in]`, B `[out, r]`) of each part it adapts into `slot` (as the layer shards
        them); the parts it leaves alone, and the rows past its rank, become zeros."""
        ranks = slice(slot * self.rank, (slot + 1) * self.rank)
        for shard_id, part in self.parts.items():
            part.a_t[slot].zero_()
            part.bt[ranks].zero_()
            pair = pairs.get(shard_id)
            if pair is None:
                continue
            a, b = self.layer.lora_factors(*pair, shard_id)
            r = a.shape[0]
            part.a_t[slot, :, :r].copy_(a.t())
            part.bt[slot * self.rank : slot * self.rank + r].copy_(b.t())

    def add(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """out `[T, out]` += each token's adapter's low-rank product of x `[T, in]` (this rank's part of it): on the
        CPU kernel each token against its own slot, on torch's matmuls every token against every slot in use."""
        _add_parts(x, out, self._part_slots, self.rank, batch)

    def add_per_token(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """`add` on the CPU kernel, whatever x is (the tests compare the two ways)."""
        _add_parts(x, out, self._part_slots, self.rank, batch, per_token=True)

    def add_masked(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """`add` on torch's matmuls, whatever x is."""
        _add_parts(x, out, self._part_slots, self.rank, batch, per_token=False)

    def add_in_graph(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`add` inside a compiled graph: the op that adds the step's products, if the step has adapters."""
        weights = [t for part in self.parts.values() for t in (part.a_t, part.bt)]
        torch.ops.ferry.lora_add(out, x, weights, [part.offset for part in self.parts.values()], self.rank)
