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
        self.on_loaded: Callable[[], None] | None = None
        """Set by a tied LM head: called once the matrix is loaded, for the head to take it into its layout."""
        self._lookup: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Where rows come from once a tied head keeps the matrix in a layout of its own (`read_rows_from`)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.vocab_per_rank)
        hidden = self._rows(local.masked_fill(elsewhere, 0)).masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return hidden if self.all_reduce is None else self.all_reduce(hidden)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self._lookup is None else self._lookup(ids)

    def read_rows_from(self, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Let go of the plain matrix and look rows up through `lookup`: a tied LM head's, which keeps the one copy
        of the matrix in its method's layout."""
        del self.weight
        self._lookup = lookup

    @torch.no_grad()
    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        target, source = _vocab_rows(self.weight, loaded, self.shard)
        target.copy_(source)
        if self.on_loaded is not None:
            self.on_loaded()


class ParallelLMHead(LinearBase):
    """This rank's `[vocab_per_rank, hidden]` rows of the output projection (the logits of its part of the
    vocabulary). Tied to an embedding, the embedding's loading fills the matrix and the head's method then takes
    it into its layout. Where that layout gives rows back (`embeds_rows`) the matrix is stored once: the plain
    layout is the embedding's own, and from another one the embedding reads its rows through the head
    (`embed_rows`). Where it cannot (oneDNN's packed layout, a bfloat16 head on a CPU that multiplies bfloat16:
    engine/models/loader.py's `_tied_head_method`), the embedding keeps the plain matrix beside the head's."""

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
        super().__init__(hidden_size, -(-vocab_size // shard.size), bias=False, method=method, dtype=dtype, shard=shard)
        self.tied = tied
        self._hand_rows: Callable[[Callable[[torch.Tensor], torch.Tensor]], None] | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding`'s matrix: one parameter for both until it is loaded (set again after `to_empty`, which
        gives each its own storage); then the head's method takes it, and the embedding reads rows from there."""
        assert self.tied
        self.weight = embedding.weight
        self._hand_rows = embedding.read_rows_from
        embedding.on_loaded = self.finish_loading

    def finish_loading(self) -> None:
        super().finish_loading()
        if self._hand_rows is not None and self.method.embeds_rows and not self.method.plain_layout:
            self._hand_rows(self.embed_rows)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embed_rows(self, ids)

    def _placement(
        self, name: str, param: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _vocab_rows(param, loaded, self.shard)
