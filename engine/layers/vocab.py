"""The vocabulary-parallel embedding and LM head: each rank holds `vocab_per_rank` rows of the vocabulary from
`rank * vocab_per_rank` (the last rank's padded with zero rows past the real vocabulary)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import ONE_RANK, LinearBase, Shard, ShardId
from engine.layers.linear_method import LinearMethod


def _vocab_rows(param: torch.Tensor, loaded: torch.Tensor, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's rows of `param` that `loaded` has, those rows of `loaded`); the rows past the real vocabulary
    are zeroed here, in place, so no padded copy of the checkpoint's matrix is ever made."""
    rows = loaded[shard.rank * param.shape[0] : (shard.rank + 1) * param.shape[0]]
    param[rows.shape[0] :].zero_()
    return param[: rows.shape[0]], rows


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table: with several ranks a token another rank holds embeds as zeros
    here, and `all_reduce` adds up each token's one real row."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.vocab_per_rank = -(-vocab_size // shard.size)
        self.start = shard.rank * self.vocab_per_rank
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.vocab_per_rank)
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return hidden if self.all_reduce is None else self.all_reduce(hidden)

    @torch.no_grad()
    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        target, source = _vocab_rows(self.weight, loaded, self.shard)
        target.copy_(source)


class ParallelLMHead(LinearBase):
    """This rank's `[vocab_per_rank, hidden]` rows of the output projection (the logits of its part of the
    vocabulary). Tied to an embedding, it reads that embedding's matrix, stored once: its method must then keep
    the plain layout the embedding's lookup reads."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        method: LinearMethod,
        dtype: torch.dtype | None = None,
        shard: Shard = ONE_RANK,
        tied: bool = False,
    ) -> None:
        if tied and not method.plain_layout:
            raise ValueError(f"a tied LM head reads the embedding's matrix: {type(method).__name__} would repack it")
        super().__init__(hidden_size, -(-vocab_size // shard.size), bias=False, method=method, dtype=dtype, shard=shard)
        self.tied = tied
        if tied:
            self._pending.clear()  # the embedding's loading fills the matrix

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Read `embedding`'s matrix: one parameter for both (set again after `to_empty`, which gives each its own
        storage)."""
        assert self.tied
        self.weight = embedding.weight

    def _placement(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _vocab_rows(param, loaded, self.shard)
