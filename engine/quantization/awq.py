"""AWQ checkpoints (AutoAWQ's GEMM layout, which GPTQModel writes too): 4-bit codes on the int4 kernel.

A layer `[out, in]` is stored transposed against GPTQ's packing: the codes are packed along the output.
- `qweight` `[in, out / 8]` int32 and `qzeros` `[groups, out / 8]` int32: eight outputs a word, interleaved: the
  word's n-th 4 bits (from the lowest) hold output 8j + ORDER[n] (AutoAWQ's kernels dequantize eight at once in
  that order);
- `scales` `[groups, out]`: w = scale * (q - zero), the zero points as they are (no offset).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.quantization.grouped import unpack_words

BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The output each 4 bits of a word hold, from the lowest."""
_UNORDER = torch.argsort(torch.tensor(ORDER))


def unpack_outputs(words: torch.Tensor) -> torch.Tensor:
    """`[rows, out / 8]` int32 in AWQ's order -> `[rows, out]` uint8 codes in output order."""
    codes = unpack_words(words, BITS, 1)  # [rows, out], each 8 in packing order
    rows, outputs = codes.shape
    return codes.view(rows, outputs // 8, 8)[..., _UNORDER].reshape(rows, outputs)


@dataclass(frozen=True)
class AWQLayout:
    group_size: int | None
    bits: int = BITS
    act_order: bool = False
    format: str = "awq"

    def checkpoint_names(self, bias: bool) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"qweight", "qzeros", "scales"} | ({"bias"} if bias else set())), frozenset()

    def unpack(self, name: str, loaded: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "qweight":
            yield "codes", unpack_outputs(loaded).t()  # [in, out] -> [out, in]
        elif name in ("qzeros", "scales"):
            per_group = (unpack_outputs(loaded) if name == "qzeros" else loaded).t().float()  # [out, groups]
            yield name.removeprefix("q"), per_group[:, 0] if self.group_size is None else per_group
