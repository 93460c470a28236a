"""The runner's side of the decode graphs: decode steps padded to a graph size, and the static buffers they replay.

A graph bakes in the addresses of its inputs, so every graph reads one set of device buffers, sized for the
largest graph and written only by `load` (the runner's `run`): a step prepared ahead (async scheduling) fills its
own host rows and never touches what a replay reads. A step of n sequences padded to size s has

    rows [0, n)     the step's sequences, exactly the eager step's inputs (one token per sequence, so token i is
                    sequence i's)
    rows [n, s)     padding: token 0 at position 0 of a one-token sequence whose page table and slot are its
                    group's scratch page

With LoRA adapters (--enable-lora) each size is captured twice: the base model's forward, and the adapted one,
which reads each row's adapter slot (-1 on padding rows and base rows) and the slots' scalings from static buffers
of their own and computes every slot's product (`LoRABatch.num_slots` is all of them: which slots a step uses
varies, a graph's shapes cannot). A step without adapters replays the base graph and pays nothing for them.

Which steps replay, the sizes and the capture strategies are engine/execution/cuda_graphs.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionBackend, StepMetadata
from engine.execution.cuda_graphs import Capture, StepFn
from engine.execution.input_batch import InputBatch, PackedStep, StepBuffers
from engine.lora.batch import LoRABatch

ModelForward = Callable[[torch.Tensor, list[StepMetadata], LoRABatch | None], torch.Tensor]
"""The model over token ids and each KV-cache group's metadata, with the step's LoRA batch, inside the step context:
[tokens, hidden]."""


class StaticAdapters:
    """The adapted graphs' LoRA inputs: each row's slot and each slot's scaling, on the device, written by `load`."""

    def __init__(self, rows: int, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.rank, self.dtype = rank, dtype

    def batch(self, size: int) -> LoRABatch:
        """The LoRA batch a graph of `size` rows captures: views of the static buffers, every slot in it."""
        return LoRABatch(self.scalings.shape[0], self.slots[:size], self.scalings, self.rank, self.dtype)

    def load(self, lora: LoRABatch, size: int) -> None:
        """The step's slots (its rows first, then -1 for padding up to `size`) and scalings, in place."""
        n = lora.slots.shape[0]
        self.slots[:n].copy_(lora.slots, non_blocking=True)
        self.slots[n:size].fill_(-1)
        self.scalings[: lora.num_slots].copy_(lora.scalings, non_blocking=True)


class PaddedDecode:
    """Decode steps of up to `sizes[-1]` sequences, padded to the next of `sizes` (ascending), each size's forward
    captured at construction, largest first, over a step of padding rows only (what the static buffers hold until
    a step overwrites them); with `adapters`, each size's adapted forward too."""

    def __init__(
        self,
        sizes: tuple[int, ...],
        capture: Capture,
        forward: ModelForward,
        batch: InputBatch,
        backend: AttentionBackend,
        scratch_pages: list[int],
        max_rows: int,
        adapters: StaticAdapters | None = None,
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > max_rows:
            raise ValueError(f"graph sizes must ascend from 1 up to {max_rows}, got {sizes}")
        self.sizes = tuple(sizes)
        self._batch = batch
        self._backend = backend
        self._forward = forward
        self._scratch_pages = scratch_pages
        self._adapters = adapters
        largest = sizes[-1]
        staging = batch.buffers[0]
        self._static = {
            name: torch.empty(
                (largest + 1 if name == "query_start_loc" else largest, *t.shape[1:]), dtype=t.dtype, device=t.device
            )
            for name, t in staging.device.items()
            if name != "logits_rows"
        }
        """The graphs' inputs on the device (rows for the largest size), written by `load` only."""
        self._write_padding(staging.np, 0, largest)
        self.load(staging, largest)
        self._metas: dict[int, list[StepMetadata]] = {}
        self._steps: dict[tuple[int, bool], StepFn] = {}
        """Each (size, adapted) forward as captured."""
        for size in reversed(sizes):
            self._metas[size] = self._static_metas(size)
            self._steps[size, False] = capture(functools.partial(self._padded_forward, size, False))
            if adapters is not None:
                self._steps[size, True] = capture(functools.partial(self._padded_forward, size, True))

    def prepare(self, packed: PackedStep, size: int) -> tuple[torch.Tensor, list[StepMetadata]]:
        """The decode step whose host rows the input batch packed, completed with padding rows up to `size`: the
        static token ids and that size's metadata, which `load` fills from these host rows. Page tables are whole
        rows (the static shape), the real ones as for an eager step."""
        host = packed.buffers.np
        num_seqs = len(packed.seqs)
        self._write_padding(host, num_seqs, size)
        widest = -(-int(packed.seq_lens.max()) // self._batch.page_size)
        positions = host["positions"][:num_seqs]
        for g in range(self._batch.num_groups):
            self._batch.write_tables(host, g, packed.seq_rows, widest, np.arange(num_seqs), positions)
        return self._static["input_ids"][:size], self._metas[size]

    def load(self, buffers: StepBuffers, size: int, lora: LoRABatch | None = None) -> None:
        """The first `size` rows of every graph input, from `buffers`' host rows into the static device buffers (in
        place: the graphs read these addresses), and the step's LoRA batch into the adapted graphs' inputs. On CUDA
        the copies queue behind the step before on the stream."""
        rows = {name: size for name in self._static}
        rows["query_start_loc"] = size + 1
        for name, n in rows.items():
            self._static[name][:n].copy_(buffers.host[name][:n], non_blocking=True)
        if lora is not None:
            if self._adapters is None:
                raise RuntimeError("a step with LoRA adapters, yet the decode graphs were captured without them")
            self._adapters.load(lora, size)

    def replay(self, size: int, adapted: bool = False) -> torch.Tensor:
        """What the capture made of the padded forward of `size` (on CUDA its graph's replay), the adapted one for a
        step with LoRA adapters: [size, hidden]."""
        return self._steps[size, adapted]()

    def _write_padding(self, host: dict[str, np.ndarray], first: int, size: int) -> None:
        """Host rows [first, size) become padding rows (row i is token i and sequence i alike)."""
        page_size = self._batch.page_size
        host["input_ids"][first:size] = 0
        host["positions"][first:size] = 0
        host["query_start_loc"][first + 1 : size + 1] = np.arange(first + 1, size + 1)
        host["seq_lens"][first:size] = 1
        for g, scratch in enumerate(self._scratch_pages):
            host[f"page_tables{g}"][first:size] = scratch
            host[f"slot_mapping{g}"][first:size] = scratch * page_size

    def _static_metas(self, size: int) -> list[StepMetadata]:
        """Each group's metadata over views of the first `size` rows of the static buffers: what a graph of that
        size captures. Its host fields describe the padding-only step it is captured with, and stay so: a
        `capturable` backend reads none of them but `max_query_len` (1 in every step a graph replays) and
        `page_size`."""
        static = self._static
        return [
            StepMetadata(
                positions=static["positions"][:size],
                slot_mapping=static[f"slot_mapping{g}"][:size],
                query_start_loc=static["query_start_loc"][: size + 1],
                seq_lens=static["seq_lens"][:size],
                page_tables=static[f"page_tables{g}"][:size],  # [size, max_pages]: whole rows, a static shape
                page_tables_host=np.full((size, static[f"page_tables{g}"].shape[1]), self._scratch_pages[g], np.int32),
                query_start_loc_host=list(range(size + 1)),
                query_lens_host=[1] * size,
                seq_lens_host=[1] * size,
                max_query_len=1,
                max_seq_len=1,
                page_size=self._batch.page_size,
            )
            for g in range(self._batch.num_groups)
        ]

    @torch.inference_mode()
    def _padded_forward(self, size: int, adapted: bool) -> torch.Tensor:
        """The model over the static buffers' first `size` rows, up to the final norm, with the static adapters
        when `adapted`: [size, hidden]. The backend's `prepare` runs inside, so what it derives on the device is
        derived again by every replay (and so is the adapters' mask, `LoRABatch.mask`)."""
        metas = self._metas[size]
        for meta in metas:
            meta.backend_state.clear()
            self._backend.prepare(meta)
        lora = self._adapters.batch(size) if adapted and self._adapters is not None else None
        return self._forward(self._static["input_ids"][:size], metas, lora)
