"""One step's tokens grouped by LoRA adapter slot: what every adapted linear layer reads (engine/lora/slots.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRABatch:
    """One step's grouping of tokens by adapter slot (see the module docstring)."""

    num_slots: int
    """Slots 0 .. num_slots - 1 may be used by the step's tokens."""
    mask: torch.Tensor
    """[T, num_slots * rank]: token t's scaling in its slot's columns, zeros elsewhere."""

    @classmethod
    def of(
        cls, token_slots: np.ndarray, scalings: np.ndarray, rank: int, device: torch.device, dtype: torch.dtype
    ) -> LoRABatch | None:
        """The batch of tokens in slots `token_slots` `[T]` (-1: the base model) whose adapters scale by `scalings`
        (per slot); None when no token has an adapter."""
        used = int(token_slots.max(initial=-1)) + 1
        if not used:
            return None
        own = token_slots[:, None] == np.arange(used)[None, :]  # [T, used]
        per_slot = np.where(own, scalings[:used][None, :], 0.0).astype(np.float32)
        mask = torch.from_numpy(np.repeat(per_slot, rank, axis=1))  # [T, used * rank]
        return cls(used, mask.to(device=device, dtype=dtype))
