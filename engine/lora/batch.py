"""One step's tokens grouped by LoRA adapter slot: what every adapted linear layer reads (engine/lora/slots.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRABatch:
    """A step's tokens by adapter slot, in the two forms the slots' two paths read: each token's slot and the slots'
    scalings (the CPU kernel), or a mask of both (torch's matmuls, `mask`)."""

    num_slots: int
    """Slots 0 .. num_slots - 1 may be used by the step's tokens (the slots are handed out lowest first)."""
    slots: torch.Tensor
    """[T] int64: each token's slot, -1 for a base-model token."""
    scalings: torch.Tensor
    """[num_slots] float32: each slot's adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)."""
    rank: int
    dtype: torch.dtype

    @classmethod
    def of(
        cls, token_slots: np.ndarray, scalings: np.ndarray, rank: int, device: torch.device, dtype: torch.dtype
    ) -> LoRABatch | None:
        """The batch of tokens in slots `token_slots` `[T]` (-1: the base model) whose adapters scale by `scalings`
        (per slot) in slots of `rank`; None when no token has an adapter."""
        used = int(token_slots.max(initial=-1)) + 1
        if not used:
            return None
        slots = torch.from_numpy(token_slots.astype(np.int64)).to(device)
        return cls(used, slots, torch.from_numpy(scalings[:used].astype(np.float32)).to(device), rank, dtype)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[T, num_slots * rank]: token t's scaling in its slot's columns, zeros elsewhere (made on first use)."""
        own = self.slots[:, None] == torch.arange(self.num_slots, device=self.slots.device)[None, :]  # [T, k]
        per_slot = torch.where(own, self.scalings[None, :], 0.0)
        return per_slot.repeat_interleave(self.rank, dim=1).to(self.dtype)  # [T, k * rank]
