"""GPTQ checkpoints (GPTQModel's and AutoGPTQ's `gptq` format; `gptq_v2`): 4-bit codes on the int4 kernel, 8-bit
ones on the grouped int8 kernel (engine/quantization/grouped.py).

A layer `[out, in]` is stored as:
- `qweight` `[in / 8, out]` int32: eight codes of consecutive inputs a word (four of 8 bits), the lowest first;
- `qzeros` `[groups, out / 8]` int32: each group's zero points, eight (four) outputs a word; the v1 format (`gptq`)
  stores each zero point minus one, subtracted from the whole word (AutoGPTQ's original kernels added the one back),
  `gptq_v2` as it is;
- `scales` `[groups, out]` (float16): w = scale * (q - zero);
- `g_idx` `[in]` int32: each input's group; in input order (`i // group_size`) unless the checkpoint was quantized
  in activation order (`desc_act`), which the int4 method gathers (engine/quantization/grouped.py).
`group_size` -1 is a scale per output row (one group).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.quantization.grouped import unpack_words


def add_one_to_each_code(words: torch.Tensor, bits: int) -> torch.Tensor:
    """v1 zero points back to v2: the writers subtract 0x11111111 (0x01010101 for 8 bits) from each whole 32-bit
    word, so a zero point of 0 borrows from the next; adding it back to the word, carries and all, undoes that
    exactly (adding one to each code apart would not)."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    wide = (words.to(torch.int64) & 0xFFFFFFFF) + ones
    wide = wide & 0xFFFFFFFF
    return torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32)


@dataclass(frozen=True)
class GPTQLayout:
    bits: int
    group_size: int | None
    act_order: bool
    zeros_minus_one: bool
    """The v1 format: zero points stored minus one."""
    format: str = "gptq"

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.act_order else set())
        return frozenset(needed | ({"bias"} if bias else set())), frozenset({"g_idx"})

    def unpack(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "qweight":
            yield "codes", unpack_words(loaded, self.bits, 0).t()  # [in, out] -> [out, in]
        elif name == "qzeros":
            if self.zeros_minus_one:
                loaded = add_one_to_each_code(loaded, self.bits)
            zeros = unpack_words(loaded, self.bits, 1).t().float()  # [out, groups]
            yield "zeros", zeros[:, 0] if self.group_size is None else zeros
        elif name == "scales":
            scales = loaded.t().float()  # [out, groups]
            yield "scales", scales[:, 0] if self.group_size is None else scales
        elif name == "g_idx" and self.act_order:
            yield "g_idx", loaded.to(torch.int32)
        elif name == "g_idx":
            # In input order it says nothing the group size does not; a checkpoint where it says otherwise is not
            # what its config claims.
            size = len(loaded) if self.group_size is None else self.group_size
            if not torch.equal(loaded.long(), torch.arange(len(loaded)) // size):
                raise ValueError("g_idx is not in input order, yet the checkpoint's config says desc_act false")
