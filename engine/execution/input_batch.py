"""The runner's input batch: the sequences it runs (a page-table row each, and what sampling reads), kept in step
with the plans' deltas, and the two sets of step buffers a step's inputs are packed into.

The batch learns of new, grown, preempted and finished sequences only from plans (`apply`): new requests arrive
with their whole page tables, continuing ones with the pages appended this step. `pack` writes a step's token
ids, positions, query starts, sequence lengths and logits rows into the next buffer set, and `write_tables` each
group's page-table rows and slot mappings, all with vectorised numpy ops over per-sequence offsets, never a loop
over tokens. The two sets are used by steps in turn: a step prepared ahead (async scheduling) fills one while the
step before it (its forward pass, or on CUDA its copies to the device) reads the other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import StepMetadata
from engine.core.request import PoolingParams, SamplingParams, Spans
from engine.core.step import PLACEHOLDER, NewRequest, SchedulerOutput
from engine.layers.ssm import StateStep
from engine.lora.batch import LoRABatch
from engine.lora.manager import SlotLoads
from engine.multimodal.inputs import ImageInput
from engine.pooling.pooler import PoolState
from engine.sampling.sampler import BatchNeeds
from engine.sampling.token_masks import GrammarState


@dataclass(slots=True)
class SequenceState:
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
    pooling: PoolingParams | None = None
    """Set for a request that pools its prompt (never sampled)."""
    pool: PoolState | None = None
    """A pooling request's state across the chunks of its prompt."""
    images: tuple[ImageInput, ...] = ()
    """The images among its prompt tokens, prompt order."""
    rope: tuple[np.ndarray, int] | None = None
    """With M-RoPE and images: each prompt token's rotary position per axis `[axes, prompt]`, and the offset of the
    positions after the prompt (the model's `rope_positions`); None: a token's own position on every axis."""
    state_slot: int = -1
    """Its recurrent-state slot (a model with recurrent layers; -1 otherwise)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        return self.output_ids[position - len(self.prompt_ids)]

    def extend_at(self, position: int, tokens: list[int]) -> list[int]:
        """Add the tokens a step produced from `position` on; positions already known keep their tokens (a step
        planned ahead sampled where an earlier step returned several, as the scheduler decides too)."""
        known = len(self.prompt_ids) + len(self.output_ids) - position
        new = tokens if known <= 0 else tokens[known:]  # per sequence and step: no copy in the common case
        self.output_ids += new
        return new


@dataclass
class StepBuffers:
    """One set of a step's buffers: host staging (pinned on CUDA, so copies to the device are async), numpy views
    of it, and the device copies (the host tensors themselves on CPU)."""

    host: dict[str, torch.Tensor]
    np: dict[str, np.ndarray]
    device: dict[str, torch.Tensor]
    _views: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Each buffer's last `to_device` views, (rows, host, device): steps of one size take the same views again,
    where slicing them anew cost a few microseconds a buffer and step."""

    @classmethod
    def allocate(cls, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> StepBuffers:
        pin = device.type == "cuda"
        host = {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
        on_device = {name: torch.empty_like(t, device=device) for name, t in host.items()} if pin else host
        return cls(host, {name: t.numpy() for name, t in host.items()}, on_device)

    def to_device(self, name: str, n: int) -> torch.Tensor:
        """The first `n` rows of buffer `name` on the device (on CUDA copied there now; on CPU the host rows)."""
        views = self._views.get(name)
        if views is None or views[0] != n:
            host = self.host[name][:n]
            views = self._views[name] = (n, host, host if self.device is self.host else self.device[name][:n])
        _, host, device = views
        return device if device is host else device.copy_(host, non_blocking=True)


@dataclass(frozen=True, slots=True)
class PoolingRows:
    """One pooling sequence's chunk in a step: packed rows `[first, end)`, positions from `start`."""

    request_id: str
    seq: SequenceState
    first: int
    end: int
    start: int
    ends_prompt: bool
    """The chunk computes the prompt's last token: the step pools the sequence."""
    logits_row: int | None = None
    """Where the logits of its last token are (a yes/no reranker reads two of them), when it ends the prompt."""


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    """On the device; on CUDA its copy is issued by `load_inputs`, once the placeholders are filled."""
    metas: list[StepMetadata]
    """One per KV-cache group (positions shared, page tables and slot mappings its own)."""
    logits_rows: torch.Tensor  # [S + D + P] rows of each sampling sequence's last known token, drafts, prompt rows
    num_sampling: int
    """S: the first rows of the logits are the sampling sequences'; the P after them score prompt tokens."""
    prompt_spans: list[tuple[str, int, int, int]]
    """(request id, first prompt position scored, count, alternatives wanted) per sequence that wants prompt
    logprobs, row order."""
    prompt_targets: list[int]
    """The prompt token each of the P prompt rows scores."""
    sampling: list[SequenceState]
    """The sequences sampled, row order: taken when prepared, since a later plan may drop them from the runner."""
    constrained: list[int]
    """The rows of `sampling` with a grammar (structured output)."""
    placeholders: list[tuple[int, SequenceState, int]]
    """(packed token index, sequence, position) of each PLACEHOLDER: its token there, filled in by `run`."""
    sample_positions: list[int]
    """The position of the first token sampled for each of `sampling`."""
    buffers: StepBuffers
    sampling_needs: BatchNeeds
    """What `sampling` may ask of the sampler, as the batch stood when prepared."""
    pooling: list[PoolingRows] = field(default_factory=list)
    """The step's chunks of pooling sequences, packing order."""
    token_type_ids: torch.Tensor | None = None
    """[T] each token's segment, for a model that reads them (an encoder); None otherwise."""
    prepare_seconds: float = 0.0
    drafts: list[tuple[int, ...]] = field(default_factory=list)
    """Per sampling sequence, the drafts it verifies (empty: none); empty when the step has none. Their logits
    rows follow the S sampling rows (see `PackedStep.num_draft_rows`), before the prompt rows."""
    lora: LoRABatch | None = None
    """The step's tokens by LoRA adapter slot (engine/lora/); None when none has an adapter."""
    lora_loads: SlotLoads = field(default_factory=list)
    """Adapters copied into their slots just before the forward pass."""
    rope_positions: torch.Tensor | None = None
    """[axes, T] on the device: the tokens' rotary positions, for a model with several rotary axes (M-RoPE)."""
    image_rows: list[tuple[int, str, int, int]] = field(default_factory=list)
    """(first packed row, image content hash, first embedding, count) per stretch of image tokens in the step:
    those rows take the image's embeddings instead of their tokens'."""
    encodes: tuple[ImageInput, ...] = ()
    """Images to encode before the forward pass (the plan's)."""
    freed_encodings: tuple[str, ...] = ()
    """Encodings to drop before those are made (the plan's)."""
    graph_size: int | None = None
    """Set for a decode step padded to this graph size: `input_ids` and `metas` are that size's static buffers,
    loaded from `buffers` by `run` (rows past the step's sequences are padding), and the forward pass replays its
    graph."""
    states: StateStep | None = None
    """A model with recurrent layers: the step's sequences' state slots and token rows (engine/layers/ssm.py)."""

    @property
    def meta(self) -> StepMetadata:
        """The primary group's metadata (the only one, unless the model mixes attention kinds)."""
        return self.metas[0]


@dataclass
class PackedStep:
    """A step's host rows as `InputBatch.pack` wrote them, and the per-sequence offsets they came from."""

    buffers: StepBuffers
    seqs: list[SequenceState]
    """The step's sequences, packing order."""
    seq_rows: np.ndarray  # [B] each sequence's page-table row
    cu_q: np.ndarray  # [B + 1] cumulative query lengths
    seq_lens: np.ndarray  # [B] KV length of each sequence after this step
    seq_of_token: np.ndarray  # [T]
    max_query_len: int
    num_sampling: int
    """Logits rows [0, num_sampling) are the sampling sequences' last known tokens."""
    sampling: list[SequenceState]
    sample_positions: list[int]
    """The position of the first token sampled for each of `sampling`."""
    placeholders: list[tuple[int, SequenceState, int]]
    """(packed token index, sequence, position) of each PLACEHOLDER: its token there, filled in by `run`."""
    drafts: list[tuple[int, ...]]
    """Per sampling sequence, its drafts (empty: none); empty when the step has none."""
    num_draft_rows: int
    """Logits rows [num_sampling, num_sampling + num_draft_rows) follow each draft, sequence by sequence."""

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q[-1])


GrammarOf = Callable[[NewRequest], GrammarState | None]
"""A new request's grammar state (structured output), or None."""


class InputBatch:
    def __init__(
        self,
        num_groups: int,
        max_seqs: int,
        max_tokens: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        # Every running sequence's page table, one row each; a step gathers its sequences' rows.
        self.tables = [np.zeros((max_seqs, max_pages), dtype=np.int32) for _ in range(num_groups)]
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self.seqs: dict[str, SequenceState] = {}
        self.scoring_prompts: set[str] = set()
        """Sequences that want prompt logprobs: the only ones a step looks at for prompt rows."""
        self.num_constrained = 0
        self.num_with_spans = 0
        """Sequences with non-causal spans: a step looks for spans only while there are any."""
        self.num_pooling = 0
        """Pooling sequences: a step looks for them only while there are any."""
        self._num_needing = dict.fromkeys(("penalties", "random", "logprobs"), 0)
        """Sequences using each of the sampler's per-request features (`BatchNeeds`)."""
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            # Sampling rows (one per sequence), then rows scoring prompt tokens (at most the step's tokens).
            "logits_rows": ((max_seqs + max_tokens,), torch.int64),
        }
        for g in range(num_groups):
            shapes[f"slot_mapping{g}"] = ((max_tokens,), torch.int64)
            shapes[f"page_tables{g}"] = ((max_seqs, max_pages), torch.int32)
        # Two sets, used by steps in turn: a step prepared ahead fills one while the step before it reads the other.
        self.buffers = [StepBuffers.allocate(shapes, device) for _ in range(2)]
        self._num_packed = 0

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def apply(self, plan: SchedulerOutput, grammar_of: GrammarOf) -> None:
        """The plan's deltas: drop finished and preempted sequences, add new ones, append granted pages."""
        for request_id in itertools.chain(plan.preempted_ids, plan.finished_ids):
            seq = self.seqs.pop(request_id, None)
            if seq is not None:
                self._free_rows.append(seq.row)
                self.scoring_prompts.discard(request_id)
                self.num_constrained -= seq.grammar is not None
                self.num_with_spans -= bool(seq.noncausal_spans)
                self.num_pooling -= seq.pooling is not None
                self._count_needs(seq.params, -1)
        for new in plan.new_requests:
            self._add(new, grammar_of(new))
        for request_id, lengths in plan.shrunk_tables:
            self.seqs[request_id].num_pages[:] = lengths
        for request_id, grant in plan.new_pages:
            seq = self.seqs[request_id]
            for g, pages in enumerate(grant):
                held = seq.num_pages[g]
                self.tables[g][seq.row, held : held + len(pages)] = pages
                seq.num_pages[g] = held + len(pages)

    def _add(self, new: NewRequest, grammar: GrammarState | None) -> None:
        if new.request_id in self.seqs:
            raise ValueError(f"the runner already runs {new.request_id!r}")
        row = self._free_rows.pop()
        for tables, pages in zip(self.tables, new.page_tables, strict=True):
            tables[row].fill(0)
            if pages:
                # Pages a sliding window released (-1) are outside every visible range: any page id will do.
                tables[row, : len(pages)] = np.maximum(pages, 0)
        self.seqs[new.request_id] = SequenceState(
            row,
            [len(pages) for pages in new.page_tables],
            new.params,
            new.eos_token_ids,
            new.generator_seed,
            new.prompt_ids,
            list(new.output_ids),
            new.params.prompt_logprobs,
            grammar,
            new.noncausal_spans,
            new.pooling,
            PoolState() if new.pooling is not None else None,
            new.images,
            state_slot=-1 if new.state_slot is None else new.state_slot,
        )
        self.num_constrained += grammar is not None
        self.num_with_spans += bool(new.noncausal_spans)
        self.num_pooling += new.pooling is not None
        self._count_needs(new.params, 1)
        if new.params.prompt_logprobs is not None:
            self.scoring_prompts.add(new.request_id)

    def _count_needs(self, params: SamplingParams, change: int) -> None:
        counts = self._num_needing
        counts["penalties"] += change * params.penalised
        counts["random"] += change * (not params.greedy)
        counts["logprobs"] += change * params.logprobs

    @property
    def sampling_needs(self) -> BatchNeeds:
        """What any running sequence asks of the sampler: a step's sampling rows ask for no more."""
        return BatchNeeds(**{feature: count > 0 for feature, count in self._num_needing.items()})

    def pack(self, plan: SchedulerOutput) -> PackedStep:
        """The plan's token ids, positions, query starts, sequence lengths and sampling rows, into the next buffer
        set's host rows (a non-empty plan, its deltas applied)."""
        buffers = self.buffers[self._num_packed % 2]
        self._num_packed += 1
        num_seqs = len(plan.request_ids)
        seqs = [self.seqs[rid] for rid in plan.request_ids]
        seq_rows = np.fromiter((seq.row for seq in seqs), dtype=np.intp, count=num_seqs)
        q_lens = np.asarray(plan.num_new_tokens, dtype=np.int64)
        starts = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        tokens = list(itertools.chain.from_iterable(plan.token_ids))
        total = len(tokens)
        host = buffers.np
        input_ids = host["input_ids"][:total]
        input_ids[:] = tokens
        positions = host["positions"][:total]
        # Array methods, not numpy's module functions: a decode step's arrays are a few elements, where the
        # functions' Python wrappers cost more than the work.
        max_query_len = max(plan.num_new_tokens)
        if max_query_len == 1:  # one token a sequence (decode): no cumulative sums or repeats to take
            cu_q = np.arange(num_seqs + 1, dtype=np.int64)
            seq_of_token = cu_q[:-1]
            positions[:] = starts
        else:
            cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
            q_lens.cumsum(out=cu_q[1:])
            seq_of_token = np.arange(num_seqs).repeat(q_lens)
            positions[:] = (starts - cu_q[:-1]).repeat(q_lens) + np.arange(total)
        seq_lens = starts + q_lens
        # Planned before the step that samples them (async scheduling): `run` fills them in.
        placeholders = (
            [
                (token, seqs[seq_of_token[token]], int(positions[token]))
                for token in np.flatnonzero(input_ids == PLACEHOLDER).tolist()
            ]
            if PLACEHOLDER in tokens
            else []
        )
        host["query_start_loc"][: num_seqs + 1] = cu_q
        host["seq_lens"][:num_seqs] = seq_lens
        samples = np.asarray(plan.samples, dtype=bool)
        ends = cu_q[1:][samples]
        sample_positions = seq_lens[samples]
        drafts: list[tuple[int, ...]] = []
        num_draft_rows = 0
        if plan.draft_token_ids:
            # Each drafting sequence samples before its drafts (its row among the first S) and after each draft
            # (rows after the S, in sequence order); the first token it gets sits before the drafts.
            drafts = [d for d, sampled in zip(plan.draft_token_ids, plan.samples, strict=True) if sampled]
            counts = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
            num_draft_rows = int(counts.sum())
            ends = ends - counts  # each sequence's first draft sits here: its draft rows start at it
            within = np.arange(num_draft_rows) - np.repeat(np.cumsum(counts) - counts, counts)
            host["logits_rows"][len(ends) : len(ends) + num_draft_rows] = np.repeat(ends, counts) + within
            sample_positions = sample_positions - counts
        rows = ends - 1
        host["logits_rows"][: len(rows)] = rows
        return PackedStep(
            buffers,
            seqs,
            seq_rows,
            cu_q,
            seq_lens,
            seq_of_token,
            max_query_len,
            len(rows),
            [seq for seq, sampled in zip(seqs, plan.samples, strict=True) if sampled],
            sample_positions.tolist(),
            placeholders,
            drafts,
            num_draft_rows,
        )

    def write_tables(
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
        tables[:] = self.tables[g][seq_rows, :widest]
        host[f"slot_mapping{g}"][: len(positions)] = (
            tables[seq_of_token, positions // self.page_size] * self.page_size + positions % self.page_size
        )
