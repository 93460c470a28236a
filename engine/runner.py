"""Owns the tensors: the paged KV cache, persistent step buffers, packing, and logits at last tokens.

Every scheduled token of every sequence goes into one unpadded row. Per-step work is per sequence, never per
token: token ids are copied slice-wise into preallocated buffers and positions / slot mappings are computed with
vectorised numpy ops from per-sequence offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, StepMetadata
from engine.kv_groups import GroupLayout
from engine.request import Request


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    metas: list[StepMetadata]
    """One per KV-cache group (positions shared, block tables and slot mappings its own)."""
    logits_rows: torch.Tensor  # [S] packed-row index of each sampling sequence's last token

    @property
    def meta(self) -> StepMetadata:
        """The primary group's metadata (the only one, unless the model mixes attention kinds)."""
        return self.metas[0]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        layouts: list[GroupLayout],
        pool_sizes: list[int],
        page_size: int,
        max_batch_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.device = device
        self.group_of_layer = [0] * model.num_layers
        for g, layout in enumerate(layouts):
            for layer in layout.layers:
                self.group_of_layer[layer] = g
        self.kv_caches = []
        for layer in range(model.num_layers):
            shape = (pool_sizes[self.group_of_layer[layer]], page_size, model.num_kv_heads, model.head_dim)
            self.kv_caches.append(
                (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            )
        max_pages = -(-max_model_len // page_size)
        pin = device.type == "cuda"
        # Host staging buffers, reused every step; on CUDA they are pinned so copies to the device are async.
        self._host = {
            "input_ids": torch.zeros(max_batch_tokens, dtype=torch.int64, pin_memory=pin),
            "positions": torch.zeros(max_batch_tokens, dtype=torch.int64, pin_memory=pin),
            "query_start_loc": torch.zeros(max_num_seqs + 1, dtype=torch.int32, pin_memory=pin),
            "seq_lens": torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=pin),
            "logits_rows": torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin),
        }
        for g in range(len(layouts)):
            self._host[f"slot_mapping{g}"] = torch.zeros(max_batch_tokens, dtype=torch.int64, pin_memory=pin)
            self._host[f"block_tables{g}"] = torch.zeros((max_num_seqs, max_pages), dtype=torch.int32, pin_memory=pin)
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._device_buffers = (
            {name: torch.empty_like(t, device=device) for name, t in self._host.items()} if pin else self._host
        )

    @staticmethod
    def kv_bytes_per_layer_page(model: torch.nn.Module, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V one layer keeps in one page (a group's page holds this for each of its layers)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * page_size * model.num_kv_heads * model.head_dim * element

    def prepare(
        self,
        requests: list[Request],
        num_new_tokens: list[int],
        block_tables: list[list[list[int]]],
        sampling: list[bool],
    ) -> StepInputs:
        """`block_tables[g][i]`: request i's pages in KV-cache group g."""
        num_seqs = len(requests)
        q_lens = np.asarray(num_new_tokens, dtype=np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=num_seqs)
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        total = int(cu_q[-1])
        seq_lens = starts + q_lens

        ids = self._np["input_ids"]
        for request, start, n, offset in zip(requests, starts.tolist(), num_new_tokens, cu_q.tolist(), strict=False):
            ids[offset : offset + n] = request.token_slice(start, start + n)
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = self._np["positions"][:total]
        positions[:] = np.repeat(starts - cu_q[:-1], q_lens) + np.arange(total)
        self._np["query_start_loc"][: num_seqs + 1] = cu_q
        self._np["seq_lens"][:num_seqs] = seq_lens
        rows = cu_q[1:][np.asarray(sampling, dtype=bool)] - 1
        self._np["logits_rows"][: len(rows)] = rows

        sizes = {
            "input_ids": total,
            "positions": total,
            "query_start_loc": num_seqs + 1,
            "seq_lens": num_seqs,
            "logits_rows": len(rows),
        }
        dev = {name: self._to_device(name, n) for name, n in sizes.items()}
        shared = dict(
            positions=dev["positions"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            query_start_loc_host=cu_q.tolist(),
            query_lens_host=list(num_new_tokens),
            seq_lens_host=seq_lens.tolist(),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            page_size=self.page_size,
        )
        metas = []
        for g, group_tables in enumerate(block_tables):
            widest = max(len(t) for t in group_tables)
            tables = self._np[f"block_tables{g}"][:num_seqs, :widest]
            tables.fill(0)
            for row, table in zip(tables, group_tables, strict=True):
                row[: len(table)] = table
            np.maximum(tables, 0, out=tables)  # pages released by a sliding window (-1) are never read
            self._np[f"slot_mapping{g}"][:total] = (
                tables[seq_of_token, positions // self.page_size] * self.page_size + positions % self.page_size
            )
            meta = StepMetadata(
                slot_mapping=self._to_device(f"slot_mapping{g}", total),
                block_tables=self._to_device(f"block_tables{g}", num_seqs)[:, :widest],
                block_tables_host=group_tables,
                **shared,
            )
            self.backend.prepare(meta)
            metas.append(meta)
        return StepInputs(dev["input_ids"], metas, dev["logits_rows"])

    def _to_device(self, name: str, n: int) -> torch.Tensor:
        host = self._host[name][:n]
        if self._device_buffers is self._host:
            return host
        return self._device_buffers[name][:n].copy_(host, non_blocking=True)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over the packed row; logits (float32) only at the sampling sequences' last tokens."""
        layer_metas = [inputs.metas[g] for g in self.group_of_layer]
        hidden = self.model(inputs.input_ids, inputs.meta.positions, layer_metas, self.kv_caches)
        return self.model.compute_logits(hidden[inputs.logits_rows])
