"""Executes a step's plan: owns the paged KV cache, persistent step buffers, the model and the sampler.

`execute(plan)` packs every scheduled token of every sequence into one unpadded row, runs the model, computes
logits only at the sampling sequences' last tokens, and samples. The runner keeps its own state per sequence
(a row of the page-table buffer, what the sampler reads) from the plan's deltas: new requests arrive with their
whole page tables, continuing ones with the pages appended this step, finished and preempted ones are dropped.

Per-step work is per sequence, never per token: token ids are copied into preallocated buffers in one piece, and
positions, page tables and slot mappings come from vectorised numpy ops over per-sequence offsets.

`execute` is `prepare` (apply the deltas, fill the step's buffers) then `run` (forward, sample). Under async
scheduling the engine calls `prepare` for step N+1 on its own thread while `run` of step N is on the runner's, so
the step's buffers come in two sets used in turn (N+1 fills one while N's forward pass, or on CUDA its copies to
the device, read the other), a step keeps the sequences it samples from its own prepare, and a PLACEHOLDER (the
token step N samples) is filled in by `run`, just before the token ids go to the device.

With decode graphs (engine/execution/cuda_graphs.py, `use_decode_graphs`) a step whose every sequence computes one
token is padded to a graph size instead: its rows, then padding rows on the scratch pages, in its host buffers; `run`
copies them into the graphs' static inputs (one set of device buffers, written only there, so a step prepared ahead
never touches what a replay reads) and replays the captured graph of that size.

A constrained sequence (structured output) also keeps its grammar state here: it advances with every token sampled
for it, and the step's constrained rows get one grammar mask (engine/sampling/token_masks.py) that the sampler applies.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import StepMetadata
from engine.attention.base import step_spans
from engine.config import EngineConfig
from engine.core.kv_cache import GroupLayout
from engine.core.request import SamplingParams, Spans, TokenLogprob
from engine.core.step import PLACEHOLDER, ModelRunnerOutput, NewRequest, PromptLogprobs, SchedulerOutput
from engine.core.structured import GrammarCompiler
from engine.execution.cuda_graphs import Capture, StepFn, decode_graph_size
from engine.models.loader import LoadedModel
from engine.sampling.sampler import Sampler, SampleResult
from engine.sampling.token_masks import GrammarMasker, GrammarState


@dataclass(slots=True)
class _Sequence:
    """The runner's view of one running request: its page-table row and what sampling reads."""

    row: int
    num_pages: list[int]
    """Pages in its table, per group."""
    params: SamplingParams
    eos_token_ids: frozenset[int]
    generator_seed: int
    prompt_ids: tuple[int, ...]
    output_ids: list[int]
    prompt_logprobs: int | None
    """Alternatives per prompt-token logprob, for a request that asked for prompt logprobs."""
    grammar: GrammarState | None
    """Set for a request with structured output."""
    noncausal_spans: Spans = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        return self.output_ids[position - len(self.prompt_ids)]

    def extend_at(self, position: int, tokens: list[int]) -> list[int]:
        """Add the tokens a step produced from `position` on; positions already known keep their tokens (a step
        planned ahead sampled where an earlier step returned several, as the scheduler decides too)."""
        new = tokens[max(0, self.num_tokens - position) :]
        self.output_ids.extend(new)
        return new


@dataclass
class _StepBuffers:
    """One set of a step's buffers: host staging (pinned on CUDA, so copies to the device are async), numpy views
    of it, and the device copies (the host tensors themselves on CPU)."""

    host: dict[str, torch.Tensor]
    np: dict[str, np.ndarray]
    device: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> _StepBuffers:
        pin = device.type == "cuda"
        host = {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
        on_device = {name: torch.empty_like(t, device=device) for name, t in host.items()} if pin else host
        return cls(host, {name: t.numpy() for name, t in host.items()}, on_device)

    def to_device(self, name: str, n: int) -> torch.Tensor:
        host = self.host[name][:n]
        if self.device is self.host:
            return host
        return self.device[name][:n].copy_(host, non_blocking=True)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    """On the device; on CUDA its copy is issued by `load_inputs`, once the placeholders are filled."""
    metas: list[StepMetadata]
    """One per KV-cache group (positions shared, page tables and slot mappings its own)."""
    logits_rows: torch.Tensor  # [S + P] packed-row index of each sampling sequence's last token, then prompt rows
    num_sampling: int
    """S: the first rows of the logits are the sampling sequences'; the P after them score prompt tokens."""
    prompt_spans: list[tuple[str, int, int, int]]
    """(request id, first prompt position scored, count, alternatives wanted) per sequence that wants prompt
    logprobs, row order."""
    prompt_targets: list[int]
    """The prompt token each of the P prompt rows scores."""
    sampling: list[_Sequence]
    """The sequences sampled, row order: taken when prepared, since a later plan may drop them from the runner."""
    constrained: list[int]
    """The rows of `sampling` with a grammar (structured output)."""
    placeholders: list[tuple[int, _Sequence, int]]
    """(packed token index, sequence, position) of each PLACEHOLDER: its token there, filled in by `run`."""
    sample_positions: list[int]
    """The position of the first token sampled for each of `sampling`."""
    buffers: _StepBuffers
    prepare_seconds: float = 0.0
    graph_size: int | None = None
    """Set for a decode step padded to this graph size: `input_ids` and `metas` are that size's static buffers,
    loaded from `buffers` by `run` (rows past the step's sequences are padding), and the forward pass replays its
    graph."""

    @property
    def meta(self) -> StepMetadata:
        """The primary group's metadata (the only one, unless the model mixes attention kinds)."""
        return self.metas[0]


PREFILL_STEP_TOKENS = 256
"""A CPU step of at least this many tokens runs on `cpu_prefill_threads` (measured on the demo model: 256 and 512
gave the same TTFT; below, decode steps with a short new prompt would take the second core from the front end)."""


def step_threads(config: EngineConfig, device: torch.device) -> tuple[int, int] | None:
    """(threads for a small step, threads for a step of PREFILL_STEP_TOKENS or more) on CPU; None where every step
    keeps one count (a GPU, cpu_threads None, or no more prefill threads than cpu_threads)."""
    if device.type != "cpu" or config.cpu_threads is None:
        return None
    prefill = config.cpu_prefill_threads
    if prefill is None:
        ranks_here = config.tensor_parallel_size // config.nnodes
        prefill = max(1, len(os.sched_getaffinity(0)) // ranks_here)
    return (config.cpu_threads, prefill) if prefill > config.cpu_threads else None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        layouts: list[GroupLayout],
        pool_pages: list[int],
        config: EngineConfig,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`grammars` compiles structured outputs (EngineCore shares its own); by default the runner has its own."""
        model = loaded.model
        self.model = model
        self.backend = loaded.backend
        self.page_size = config.page_size
        self.device = device = loaded.device
        self.sampler = Sampler(loaded.hf_config.vocab_size, device, config.seed)
        self.grammars = grammars or GrammarCompiler(
            config.model, vocab_size=loaded.hf_config.vocab_size, eos_token_ids=loaded.eos_token_ids
        )
        self.samples = loaded.rank == 0
        """False on a tensor-parallel rank other than 0: it runs its shard of each step and keeps no grammar state,
        since the driver samples."""
        self.grammar_masker: GrammarMasker | None = None
        """Built with the first constrained sequence: steps without any never touch a grammar."""
        self._max_seqs = config.max_num_seqs
        self._num_constrained = 0
        self._step_threads = step_threads(config, device)
        self.group_of_layer = [0] * model.num_layers
        for g, layout in enumerate(layouts):
            for layer in layout.layers:
                self.group_of_layer[layer] = g
        self.pool_pages = list(pool_pages)
        """Pages of each group's pool: the ids the scheduler hands out are below these."""
        self.kv_caches = []
        for layer in range(model.num_layers):
            pages = pool_pages[self.group_of_layer[layer]] + 1  # the scratch page
            shape = (pages, config.page_size, model.num_kv_heads, model.head_dim)
            self.kv_caches.append(
                (
                    torch.zeros(shape, dtype=loaded.dtype, device=device),
                    torch.zeros(shape, dtype=loaded.dtype, device=device),
                )
            )
        max_seqs, max_tokens = config.max_num_seqs, config.max_batch_tokens
        max_pages = -(-loaded.max_model_len // config.page_size)
        # Every running sequence's page table, one row each; a step gathers its sequences' rows.
        self._tables = [np.zeros((max_seqs, max_pages), dtype=np.int32) for _ in layouts]
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self._seqs: dict[str, _Sequence] = {}
        self._scoring_prompts: set[str] = set()
        """Sequences that want prompt logprobs: the only ones a step looks at for prompt rows."""
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            # Sampling rows (one per sequence), then rows scoring prompt tokens (at most the step's tokens).
            "logits_rows": ((max_seqs + max_tokens,), torch.int64),
        }
        for g in range(len(layouts)):
            shapes[f"slot_mapping{g}"] = ((max_tokens,), torch.int64)
            shapes[f"page_tables{g}"] = ((max_seqs, max_pages), torch.int32)
        # Two sets, used by steps in turn: a step prepared ahead fills one while the step before it reads the other.
        self._buffers = [_StepBuffers.allocate(shapes, device) for _ in range(2)]
        self._num_prepared = 0
        self._max_rows = min(max_seqs, max_tokens)
        self.graph_sizes: tuple[int, ...] = ()
        """Decode steps of up to graph_sizes[-1] sequences are padded to the next of these (none: all eager)."""
        self._static: dict[str, torch.Tensor] = {}
        """The graphs' inputs on the device (rows for the largest size), written by `run` only."""
        self._graph_metas: dict[int, list[StepMetadata]] = {}
        self._decode_steps: dict[int, StepFn] = {}

    @property
    def scratch_pages(self) -> list[int]:
        """Each group's scratch page, one past its pool's pages: padded decode rows write and read it alone."""
        return self.pool_pages

    @staticmethod
    def kv_bytes_per_layer_page(model: torch.nn.Module, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V one layer keeps in one page (a group's page holds this for each of its layers)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * page_size * model.num_kv_heads * model.head_dim * element

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one planned step: pack, forward, sample."""
        return self.run(self.prepare(plan))

    def run(self, inputs: StepInputs | None) -> ModelRunnerOutput:
        """Forward and sample a prepared step (None: an empty one); every step before it has run."""
        if inputs is None:
            return ModelRunnerOutput()
        started = time.perf_counter()
        if self._step_threads is not None:
            # Per thread in torch: set on the thread that runs the step (the runner's own under async scheduling).
            small, large = self._step_threads
            torch.set_num_threads(large if len(inputs.input_ids) >= PREFILL_STEP_TOKENS else small)
        logits = self.forward(inputs)
        forwarded = time.perf_counter()
        forward_seconds = forwarded - started
        if logits is None:  # a tensor-parallel rank other than 0: the driver samples, from the gathered logits
            return ModelRunnerOutput(prepare_seconds=inputs.prepare_seconds, forward_seconds=forward_seconds)
        sampling, constrained = inputs.sampling, inputs.constrained
        # After the forward pass was issued: on CUDA the CPU fills the masks while the device computes.
        grammar_bias = (
            (constrained, self._grammar_bias([sampling[row].grammar for row in constrained])) if constrained else None
        )
        token_ids, logprobs = self.step_tokens(
            inputs, self.sampler(logits[: inputs.num_sampling], sampling, grammar_bias)
        )
        added = [
            seq.extend_at(position, tokens)
            for seq, position, tokens in zip(sampling, inputs.sample_positions, token_ids, strict=True)
        ]
        for row in constrained:
            for token in added[row]:
                sampling[row].grammar.advance(token)
        return ModelRunnerOutput(
            token_ids,
            logprobs,
            self._score_prompts(logits[inputs.num_sampling :], inputs) if inputs.prompt_spans else [],
            prepare_seconds=inputs.prepare_seconds,
            forward_seconds=forward_seconds,
            sample_seconds=time.perf_counter() - forwarded,
        )

    def step_tokens(
        self, inputs: StepInputs, sampled: SampleResult
    ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """The tokens each sampling sequence gets from this step, with their logprobs: here the one sampled."""
        return [[token] for token in sampled.token_ids], [
            None if logprob is None else [logprob] for logprob in sampled.logprobs
        ]

    def load_inputs(self, inputs: StepInputs) -> None:
        """Fill each PLACEHOLDER with its sequence's latest token (sampled by the step before), then copy the token
        ids to the device (on CPU only a padded step's: it has static buffers of its own there too). `forward` does
        it first; doing it again changes nothing."""
        host = inputs.buffers.np["input_ids"]
        for token, seq, position in inputs.placeholders:
            host[token] = seq.token_at(position)
        if inputs.graph_size is None:
            inputs.buffers.to_device("input_ids", len(inputs.input_ids))
        else:
            self._load_static(inputs.buffers, inputs.graph_size)

    def with_sampled_tokens(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The plan with each PLACEHOLDER replaced by the token this runner sampled for its request: what the
        tensor-parallel ranks, which never sample, are sent under async scheduling."""
        token_ids = tuple(
            [self._seqs[request_id].token_at(start + k) if t == PLACEHOLDER else t for k, t in enumerate(ids)]
            if PLACEHOLDER in ids
            else ids
            for request_id, start, ids in zip(plan.request_ids, plan.num_computed_tokens, plan.token_ids, strict=True)
        )
        return dataclasses.replace(plan, token_ids=token_ids)

    def prepare(self, plan: SchedulerOutput) -> StepInputs | None:
        """Apply the plan's deltas to the runner's state and build the step's inputs; None for an empty step."""
        started = time.perf_counter()
        for request_id in itertools.chain(plan.preempted_ids, plan.finished_ids):
            seq = self._seqs.pop(request_id, None)
            if seq is not None:
                self._free_rows.append(seq.row)
                self._scoring_prompts.discard(request_id)
                self._num_constrained -= seq.grammar is not None
        if plan.draft_token_ids:
            raise NotImplementedError("this runner has no verifying sampler: it cannot take a plan with drafts")
        for new in plan.new_requests:
            self._add(new)
        for request_id, lengths in plan.shrunk_tables:
            self._seqs[request_id].num_pages[:] = lengths
        for request_id, grant in plan.new_pages:
            seq = self._seqs[request_id]
            for g, pages in enumerate(grant):
                held = seq.num_pages[g]
                self._tables[g][seq.row, held : held + len(pages)] = pages
                seq.num_pages[g] = held + len(pages)
        if not plan.request_ids:
            return None

        buffers = self._buffers[self._num_prepared % 2]
        self._num_prepared += 1
        num_seqs = len(plan.request_ids)
        seqs = [self._seqs[rid] for rid in plan.request_ids]
        seq_rows = np.fromiter((seq.row for seq in seqs), dtype=np.intp, count=num_seqs)
        q_lens = np.asarray(plan.num_new_tokens, dtype=np.int64)
        starts = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        total = int(cu_q[-1])
        seq_lens = starts + q_lens
        max_query_len = int(q_lens.max())
        noncausal = None
        if any(seq.noncausal_spans for seq in seqs):
            noncausal = step_spans([seq.noncausal_spans for seq in seqs], starts, seq_lens)
        # A graph's static metadata has no spans: a step with queries in one runs eagerly.
        graph_size = decode_graph_size(self.graph_sizes, num_seqs, max_query_len) if noncausal is None else None

        host = buffers.np
        input_ids = host["input_ids"][:total]
        input_ids[:] = list(itertools.chain.from_iterable(plan.token_ids))
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        # Planned before the step that samples them (async scheduling): `run` fills them in.
        positions = host["positions"][:total]
        positions[:] = np.repeat(starts - cu_q[:-1], q_lens) + np.arange(total)
        placeholders = [
            (token, seqs[seq_of_token[token]], int(positions[token]))
            for token in np.flatnonzero(input_ids == PLACEHOLDER).tolist()
        ]
        host["query_start_loc"][: num_seqs + 1] = cu_q
        host["seq_lens"][:num_seqs] = seq_lens
        samples = np.asarray(plan.samples, dtype=bool)
        rows = cu_q[1:][samples] - 1
        num_sampling = len(rows)
        host["logits_rows"][:num_sampling] = rows
        spans, targets = (
            self._prompt_rows(plan, cu_q, num_sampling, host["logits_rows"]) if self._scoring_prompts else ([], [])
        )
        num_rows = num_sampling + len(targets)
        sampling = [seq for seq, sampled in zip(seqs, plan.samples, strict=True) if sampled]
        if graph_size is None:
            step_ids, metas = self._eager_metas(
                buffers, plan, seq_rows, cu_q, seq_lens, seq_of_token, max_query_len, noncausal
            )
        else:
            step_ids, metas = self._padded_metas(buffers, graph_size, num_seqs, seq_rows, int(seq_lens.max()))
        return StepInputs(
            step_ids,
            metas,
            buffers.to_device("logits_rows", num_rows),
            num_sampling,
            spans,
            targets,
            sampling=sampling,
            constrained=[row for row, seq in enumerate(sampling) if seq.grammar is not None]
            if self._num_constrained
            else [],
            placeholders=placeholders,
            sample_positions=seq_lens[samples].tolist(),
            buffers=buffers,
            prepare_seconds=time.perf_counter() - started,
            graph_size=graph_size,
        )

    def _eager_metas(
        self,
        buffers: _StepBuffers,
        plan: SchedulerOutput,
        seq_rows: np.ndarray,
        cu_q: np.ndarray,
        seq_lens: np.ndarray,
        seq_of_token: np.ndarray,
        max_query_len: int,
        noncausal: tuple[list[Spans], np.ndarray] | None,
    ) -> tuple[torch.Tensor, list[StepMetadata]]:
        """The step's token ids on the device (loaded by `run`) and each group's metadata, unpadded."""
        host = buffers.np
        num_seqs, total = len(seq_rows), int(cu_q[-1])
        positions = host["positions"][:total]
        dev = {
            name: buffers.to_device(name, n)
            for name, n in (("positions", total), ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs))
        }
        max_seq_len = int(seq_lens.max())
        shared = dict(
            positions=dev["positions"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            query_start_loc_host=cu_q.tolist(),
            query_lens_host=list(plan.num_new_tokens),
            seq_lens_host=seq_lens.tolist(),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            page_size=self.page_size,
        )
        if noncausal is not None:
            # Rare (steps with an image's or an encoder's tokens): staged on its own rather than in a step buffer.
            spans, bounds = noncausal
            shared.update(noncausal_spans_host=spans, token_spans=torch.from_numpy(bounds).to(self.device))
        widest = -(-max_seq_len // self.page_size)
        metas = []
        for g in range(len(self._tables)):
            self._write_tables(host, g, seq_rows, widest, seq_of_token, positions)
            tables = host[f"page_tables{g}"][:num_seqs, :widest]
            meta = StepMetadata(
                slot_mapping=buffers.to_device(f"slot_mapping{g}", total),
                page_tables=buffers.to_device(f"page_tables{g}", num_seqs)[:, :widest],
                page_tables_host=tables,
                **shared,
            )
            self.backend.prepare(meta)
            metas.append(meta)
        return buffers.device["input_ids"][:total], metas

    def _padded_metas(
        self, buffers: _StepBuffers, size: int, num_seqs: int, seq_rows: np.ndarray, max_seq_len: int
    ) -> tuple[torch.Tensor, list[StepMetadata]]:
        """The decode step whose host rows `prepare` filled, completed with padding rows up to `size`: the static
        token ids and that size's metadata, which `run` loads from these host rows. Page tables are whole rows (the
        static shape), the real ones as `prepare` builds them for an eager step; one token per sequence, so token i
        is sequence i's."""
        host = buffers.np
        self._write_padding(host, num_seqs, size)
        widest = -(-max_seq_len // self.page_size)
        positions = host["positions"][:num_seqs]
        for g in range(len(self._tables)):
            self._write_tables(host, g, seq_rows, widest, np.arange(num_seqs), positions)
        return self._static["input_ids"][:size], self._graph_metas[size]

    def _write_tables(
        self,
        host: dict[str, np.ndarray],
        g: int,
        seq_rows: np.ndarray,
        widest: int,
        seq_of_token: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        """Group g's page-table rows of the step's sequences (their first `widest` columns) and the cache slot of
        each of its tokens, into the host rows."""
        tables = host[f"page_tables{g}"][: len(seq_rows), :widest]
        tables[:] = self._tables[g][seq_rows, :widest]
        host[f"slot_mapping{g}"][: len(positions)] = (
            tables[seq_of_token, positions // self.page_size] * self.page_size + positions % self.page_size
        )

    def _write_padding(self, host: dict[str, np.ndarray], first: int, size: int) -> None:
        """Host rows [first, size) become padding: token 0 at position 0 of a one-token sequence whose page table
        and slot are its group's scratch page (row i is token i and sequence i alike)."""
        host["input_ids"][first:size] = 0
        host["positions"][first:size] = 0
        host["query_start_loc"][first + 1 : size + 1] = np.arange(first + 1, size + 1)
        host["seq_lens"][first:size] = 1
        for g, scratch in enumerate(self.scratch_pages):
            host[f"page_tables{g}"][first:size] = scratch
            host[f"slot_mapping{g}"][first:size] = scratch * self.page_size

    def _load_static(self, buffers: _StepBuffers, size: int) -> None:
        """The first `size` rows of every graph input, from `buffers`' host rows into the static device buffers (in
        place: the graphs read these addresses). On CUDA the copies queue behind the step before on the stream."""
        rows = {name: size for name in self._static}
        rows["query_start_loc"] = size + 1
        for name, n in rows.items():
            self._static[name][:n].copy_(buffers.host[name][:n], non_blocking=True)

    def use_decode_graphs(self, sizes: tuple[int, ...], capture: Capture) -> None:
        """From now on pad every decode step of up to `sizes[-1]` sequences to the next of `sizes` (ascending) and
        run what `capture` made of the padded forward of that size (on CUDA, the replay of its graph;
        engine/execution/cuda_graphs.py). Called before the first step: the sizes are captured largest first, over a
        step of padding rows only, which is what the static buffers hold until a step overwrites them."""
        if self._seqs:
            raise RuntimeError("decode graphs are set up before the first step")
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > self._max_rows:
            raise ValueError(f"graph sizes must ascend from 1 up to {self._max_rows}, got {sizes}")
        largest = sizes[-1]
        staging = self._buffers[0].host
        self._static = {
            name: torch.empty(
                (largest + 1 if name == "query_start_loc" else largest, *t.shape[1:]), dtype=t.dtype, device=self.device
            )
            for name, t in staging.items()
            if name != "logits_rows"
        }
        self._write_padding(self._buffers[0].np, 0, largest)
        self._load_static(self._buffers[0], largest)
        for size in reversed(sizes):
            self._graph_metas[size] = self._static_metas(size)
            self._decode_steps[size] = capture(functools.partial(self._padded_forward, size))
        self.graph_sizes = tuple(sizes)

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
                page_tables_host=np.full((size, static[f"page_tables{g}"].shape[1]), self.scratch_pages[g], np.int32),
                query_start_loc_host=list(range(size + 1)),
                query_lens_host=[1] * size,
                seq_lens_host=[1] * size,
                max_query_len=1,
                max_seq_len=1,
                page_size=self.page_size,
            )
            for g in range(len(self._tables))
        ]

    @torch.inference_mode()
    def _padded_forward(self, size: int) -> torch.Tensor:
        """The model over the static buffers' first `size` rows, up to the final norm: [size, hidden]. The
        backend's `prepare` runs inside, so what it derives on the device is derived again by every replay."""
        metas = self._graph_metas[size]
        for meta in metas:
            meta.backend_state.clear()
            self.backend.prepare(meta)
        input_ids = self._static["input_ids"][:size]
        return self.model(input_ids, metas[0].positions, [metas[g] for g in self.group_of_layer], self.kv_caches)

    def _prompt_rows(
        self, plan: SchedulerOutput, cu_q: np.ndarray, offset: int, logits_rows: np.ndarray
    ) -> tuple[list[tuple[str, int, int, int]], list[int]]:
        """Append, after the sampling rows, the packed rows whose logits score the next prompt token."""
        spans: list[tuple[str, int, int, int]] = []
        targets: list[int] = []
        for i, request_id in enumerate(plan.request_ids):
            if request_id not in self._scoring_prompts:
                continue
            seq = self._seqs[request_id]
            prompt = seq.prompt_ids
            start, n = plan.num_computed_tokens[i], plan.num_new_tokens[i]
            # Position p's logits predict token p + 1; the last prompt position predicts the first output token.
            count = min(start + n, len(prompt) - 1) - start
            if count <= 0:
                continue
            logits_rows[offset : offset + count] = np.arange(cu_q[i], cu_q[i] + count)
            offset += count
            spans.append((request_id, start + 1, count, seq.prompt_logprobs or 0))
            targets += prompt[start + 1 : start + 1 + count]
        return spans, targets

    def _score_prompts(self, logits: torch.Tensor, inputs: StepInputs) -> list[PromptLogprobs]:
        """Each prompt row's logprob of its target token and its top alternatives, in one host transfer."""
        logprobs = torch.log_softmax(logits[:, : self.sampler.vocab_size].float(), dim=-1)
        targets = torch.tensor(inputs.prompt_targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        num_top = max(wanted for _, _, _, wanted in inputs.prompt_spans)
        num_top = min(num_top, logprobs.shape[-1])
        top = logprobs.topk(num_top, dim=-1)
        # float64 holds every token id exactly, so ids and logprobs come to the host together.
        host = torch.cat([chosen.double(), top.values.double().flatten(), top.indices.double().flatten()]).tolist()
        num_rows = len(inputs.prompt_targets)
        values, ids = host[num_rows : num_rows * (1 + num_top)], host[num_rows * (1 + num_top) :]
        results, row = [], 0
        for request_id, first, count, wanted in inputs.prompt_spans:
            entries = []
            for r in range(row, row + count):
                alternatives = [(int(ids[r * num_top + k]), values[r * num_top + k]) for k in range(wanted)]
                entries.append(TokenLogprob(inputs.prompt_targets[r], host[r], alternatives))
            results.append(PromptLogprobs(request_id, first, entries))
            row += count
        return results

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self._seqs:
            raise ValueError(f"the runner already runs {new.request_id!r}")
        row = self._free_rows.pop()
        for tables, pages in zip(self._tables, new.page_tables, strict=True):
            tables[row].fill(0)
            if pages:
                # Pages a sliding window released (-1) are outside every visible range: any page id will do.
                tables[row, : len(pages)] = np.maximum(pages, 0)
        self._seqs[new.request_id] = _Sequence(
            row,
            [len(pages) for pages in new.page_tables],
            new.params,
            new.eos_token_ids,
            new.generator_seed,
            new.prompt_ids,
            list(new.output_ids),
            new.params.prompt_logprobs,
            self._grammar_state(new),
            new.noncausal_spans,
        )
        if new.params.prompt_logprobs is not None:
            self._scoring_prompts.add(new.request_id)

    def _grammar_state(self, new: NewRequest) -> GrammarState | None:
        """A constrained request's grammar state, caught up with the tokens it generated before a preemption."""
        structured_output = new.params.structured_output
        if structured_output is None or not self.samples:
            return None
        self._num_constrained += 1
        # Compiled before the request was admitted, so this is a cache hit (a recompile only if it was evicted).
        compiled = self.grammars.compile(structured_output)
        end_token_ids = new.eos_token_ids | frozenset(new.params.stop_token_ids)
        return GrammarState(compiled, end_token_ids, new.output_ids)

    def _grammar_bias(self, states: list[GrammarState]) -> torch.Tensor:
        if self.grammar_masker is None:
            self.grammar_masker = GrammarMasker(
                self.sampler.vocab_size,
                self._max_seqs,
                self.device,
                frozenset(self.grammars.tokenizer.eos_tokens),
            )
        return self.grammar_masker.bias(states)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """One forward pass over the packed row; logits (float32) only at the sampling sequences' last tokens (and
        the prompt rows scored), None on a tensor-parallel rank other than 0."""
        self.load_inputs(inputs)
        if inputs.graph_size is not None:
            hidden = self._decode_steps[inputs.graph_size]()
        else:
            layer_metas = [inputs.metas[g] for g in self.group_of_layer]
            hidden = self.model(inputs.input_ids, inputs.meta.positions, layer_metas, self.kv_caches)
        return self.model.compute_logits(hidden[inputs.logits_rows])
