"""Executes a step's plan: owns the paged KV cache, the model and the sampler; reads as prepare, forward, sample.

`execute(plan)` packs every scheduled token of every sequence into one unpadded row, runs the model, computes
logits only at the sampling sequences' last tokens, and samples. The sequences, their page-table rows, the plan's
deltas and the packing into step buffers are the input batch's (engine/execution/input_batch.py); prompt rows and
their logprobs are engine/execution/prompt_logprobs.py's. The model runs inside the step context
(engine/attention/context.py), which the runner enters around every forward pass.

`execute` is `prepare` (apply the deltas, fill the step's buffers) then `run` (forward, sample). Under async
scheduling the engine calls `prepare` for step N+1 on its own thread while `run` of step N is on the runner's, so
the step's buffers come in two sets used in turn (N+1 fills one while N's forward pass, or on CUDA its copies to
the device, read the other), a step keeps the sequences it samples from its own prepare, and a PLACEHOLDER (the
token step N samples) is filled in by `run`, just before the token ids go to the device.

With decode graphs (engine/execution/cuda_graphs.py, `use_decode_graphs`) a step whose every sequence computes one
token is padded to a graph size instead (engine/execution/graph_inputs.py): its rows, then padding rows on the
scratch pages, in its host buffers; `run` copies them into the graphs' static inputs and replays the captured graph
of that size (with LoRA adapters in the step, that size's adapted graph).

A constrained sequence (structured output) also keeps its grammar state, which advances with every token sampled
for it; the step's constrained rows get one grammar mask that the sampler applies (engine/sampling/token_masks.py).
On CPU the step's size picks its thread count (engine/execution/cpu_threads.py).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from engine.attention import StepMetadata
from engine.attention.base import span_intervals, step_spans
from engine.attention.context import StepContext, step_context
from engine.config import EngineConfig
from engine.core.kv_cache import GroupLayout
from engine.core.request import Spans, TokenLogprob
from engine.core.step import PLACEHOLDER, ModelRunnerOutput, NewRequest, SchedulerOutput
from engine.core.structured import GrammarCompiler
from engine.execution.cpu_threads import step_threads
from engine.execution.cuda_graphs import Capture, decode_graph_size
from engine.execution.graph_inputs import PaddedDecode, StaticAdapters
from engine.execution.input_batch import InputBatch, PackedStep, PoolingRows, SequenceState, StepInputs
from engine.execution.kv_caches import allocate_kv_caches, kv_cache_dtype, layer_specs, state_bytes_per_sequence
from engine.execution.prompt_logprobs import prompt_rows, score_prompts
from engine.layers.ssm import StateStep
from engine.lora.batch import LoRABatch
from engine.lora.manager import lora_manager
from engine.models.loader import LoadedModel
from engine.multimodal.inputs import ImageInput
from engine.sampling.sampler import Sampler, SampleResult
from engine.sampling.token_masks import GrammarState, StepGrammars
from engine.sampling.verify import verify


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        layouts: list[GroupLayout],
        pool_pages: list[int],
        config: EngineConfig,
        grammars: GrammarCompiler | None = None,
        state_slots: int | None = None,
    ) -> None:
        """`grammars` compiles structured outputs (EngineCore shares its own); by default the runner has its own.
        `state_slots`: a recurrent model's state slots (engine/execution/startup.py's count; by default one per
        sequence that may run)."""
        model = loaded.model
        self.model = model
        self.backend = loaded.backend
        self.page_size = config.cache.page_size
        self.device = device = loaded.device
        self.sampler = Sampler(loaded.hf_config.vocab_size, device, config.scheduler.seed)
        vocab_size = loaded.hf_config.vocab_size
        compiler = grammars or GrammarCompiler(
            config.model.path, vocab_size=vocab_size, eos_token_ids=loaded.eos_token_ids
        )
        self.step_grammars = StepGrammars(compiler, vocab_size, config.scheduler.max_num_seqs, device)
        """Structured output: the constrained sequences' grammar states and each step's grammar bias."""
        self.samples = loaded.rank == 0
        """False on a tensor-parallel rank other than 0: it runs its shard of each step and keeps no grammar state,
        since the driver samples."""
        self.step_threads = step_threads(config, device)
        """CPU: the thread count of each step, by its size and the load beside the engine."""
        self.cpu_threads = torch.get_num_threads() if device.type == "cpu" else 0
        """Torch threads the last step ran on (0 on a GPU)."""
        self.group_of_layer = [0] * model.num_layers
        for g, layout in enumerate(layouts):
            for layer in layout.layers:
                self.group_of_layer[layer] = g
        self.pool_pages = list(pool_pages)
        """Pages of each group's pool: the ids the scheduler hands out are below these."""
        specs = layer_specs(model, kv_cache_dtype(config.cache))
        self.has_states = state_bytes_per_sequence(specs) > 0
        """The model has recurrent layers: each step carries its sequences' state slots (`StateStep`)."""
        self.kv_caches = allocate_kv_caches(
            specs,
            self.group_of_layer,
            pool_pages,
            config.cache.page_size,
            (config.scheduler.max_num_seqs if state_slots is None else state_slots) if self.has_states else 0,
            device,
        )
        """Each layer's K and V pages, as its cache spec keeps them, in --kv-cache-dtype's dtype where it names one;
        a recurrent layer's state slots (engine/execution/kv_caches.py)."""
        self.sliding_windows = [layouts[g].window for g in self.group_of_layer]
        self.group_windows = [layout.window for layout in layouts]
        self.bidirectional = loaded.pooler is not None and loaded.pooler.config.bidirectional
        """An encoder: its spans' queries see the span's keys within a window on either side (span_intervals)."""
        max_seqs, max_tokens = config.scheduler.max_num_seqs, config.scheduler.max_batch_tokens
        max_pages = -(-loaded.max_model_len // config.cache.page_size)
        self.batch = InputBatch(len(layouts), max_seqs, max_tokens, max_pages, config.cache.page_size, device)
        """The running sequences (page-table rows, sampling state) and the step buffers they are packed into."""
        self._max_rows = min(max_seqs, max_tokens)
        self.pooler = loaded.pooler
        """The model's pooling (engine/pooling/); None for a model that only generates."""
        self._takes_token_types = bool(getattr(model, "takes_token_types", False))
        self.padded_decode: PaddedDecode | None = None
        """Set by `use_decode_graphs`; None while every step runs eagerly."""
        self.lora = lora_manager(config, model, loaded.hf_config, loaded.dtype)
        """The LoRA adapters' slots and their assignment to requests (--enable-lora)."""
        self.rope_axes: int = getattr(model, "rope_axes", 1)
        """Rotary position axes of the model: 3 for M-RoPE (Qwen2-VL), whose steps pass `[3, T]` positions."""
        self.takes_images = loaded.takes_images
        self.encodings: dict[str, torch.Tensor] = {}
        """An image model's encoded images by content hash (`[length, hidden]` each): what the plans' encodes
        made and their frees have not dropped (the scheduler's encoder cache keeps the account)."""

    @property
    def scratch_pages(self) -> list[int]:
        """Each group's scratch page, one past its pool's pages: padded decode rows write and read it alone."""
        return self.pool_pages

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """Decode steps of up to graph_sizes[-1] sequences are padded to the next of these (none: all eager)."""
        return () if self.padded_decode is None else self.padded_decode.sizes

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one planned step: pack, forward, sample."""
        return self.run(self.prepare(plan))

    def run(self, inputs: StepInputs | None) -> ModelRunnerOutput:
        """Forward and sample a prepared step (None: an empty one); every step before it has run."""
        if inputs is None:
            return ModelRunnerOutput()
        started = time.perf_counter()
        if self.step_threads is not None:
            # The images it encodes count as tokens of work: a one-token chunk beside an image is a large step.
            encoded = sum(image.length for image in inputs.encodes)
            self.cpu_threads = self.step_threads.use_for(len(inputs.input_ids) + encoded, len(inputs.meta.seq_lens))
        logits, pooled = self.forward_and_pool(inputs)
        forwarded = time.perf_counter()
        forward_seconds = forwarded - started
        if logits is None:  # a tensor-parallel rank other than 0: the driver samples, from the gathered logits
            return ModelRunnerOutput(prepare_seconds=inputs.prepare_seconds, forward_seconds=forward_seconds)
        sampling, constrained = inputs.sampling, inputs.constrained
        # After the forward pass was issued: on CUDA the CPU fills the masks while the device computes.
        grammars: list[GrammarState] = [sampling[row].grammar for row in constrained]  # type: ignore[misc]
        num_sampling, drafts = inputs.num_sampling, inputs.drafts
        if drafts:
            grammar_bias = self._draft_grammar_bias(constrained, grammars, drafts, num_sampling)
            num_sampling += sum(map(len, drafts))
            # The grammars walk the kept tokens there, the budget's closing included.
            token_ids, logprobs = verify(
                self.sampler,
                logits[:num_sampling],
                sampling,
                drafts,
                grammar_bias,
                inputs.sampling_needs,
                dict(zip(constrained, grammars, strict=True)),
            )
            closed_by_budget = self._closed_rows(constrained, grammars)
        else:
            grammar_bias = (constrained, self.step_grammars.bias(grammars)) if constrained else None
            token_ids, logprobs = self.step_tokens(
                inputs, self.sampler(logits[:num_sampling], sampling, grammar_bias, inputs.sampling_needs)
            )
            closed_by_budget = []
            if grammar_bias is not None:
                closed_by_budget = self._close_within_budget(
                    logits, grammar_bias, grammars, sampling, token_ids, logprobs
                )
        added = [
            seq.extend_at(position, tokens)
            for seq, position, tokens in zip(sampling, inputs.sample_positions, token_ids, strict=True)
        ]
        if not drafts:
            self.step_grammars.advance(grammars, [added[row] for row in constrained])
        grammar_errors = {
            row: grammar.error for row, grammar in zip(constrained, grammars, strict=True) if grammar.error is not None
        }
        return ModelRunnerOutput(
            token_ids,
            logprobs,
            score_prompts(
                logits[num_sampling : num_sampling + len(inputs.prompt_targets)],
                self.sampler.vocab_size,
                inputs.prompt_spans,
                inputs.prompt_targets,
            )
            if inputs.prompt_spans
            else [],
            pooled=pooled,
            closed_by_budget=closed_by_budget,
            grammar_errors=grammar_errors,
            prepare_seconds=inputs.prepare_seconds,
            forward_seconds=forward_seconds,
            sample_seconds=time.perf_counter() - forwarded,
        )

    def _close_within_budget(
        self,
        logits: torch.Tensor,
        grammar_bias: tuple[list[int], torch.Tensor],
        grammars: list[GrammarState],
        sampling: list[SequenceState],
        token_ids: list[list[int]],
        logprobs: list[list[TokenLogprob] | None],
    ) -> list[int]:
        """Let each constrained row's grammar keep or replace its sampled token (a JSON value closing within its
        budget), with the logprob of a replaced one; the rows whose value the budget is closing. `grammars` are
        the constrained rows' states, in `grammar_bias`'s row order."""
        constrained, bias = grammar_bias
        replaced = self.step_grammars.choose(grammars, [token_ids[row] for row in constrained])
        wanted = [i for i in replaced if logprobs[constrained[i]] is not None]
        if wanted:
            rows = [constrained[i] for i in wanted]
            fresh = self.sampler.logprobs_of(
                logits[rows] + bias[wanted], [token_ids[row][0] for row in rows], [sampling[row] for row in rows]
            )
            for row, logprob in zip(rows, fresh, strict=True):
                logprobs[row] = [logprob]
        return self._closed_rows(constrained, grammars)

    @staticmethod
    def _closed_rows(constrained: list[int], grammars: list[GrammarState]) -> list[int]:
        """The constrained rows whose JSON value the budget is closing."""
        return [
            row
            for row, grammar in zip(constrained, grammars, strict=True)
            if grammar.closing is not None and grammar.closing.forced_any
        ]

    def _draft_grammar_bias(
        self, constrained: list[int], grammars: list[GrammarState], drafts: list[tuple[int, ...]], num_sampling: int
    ) -> tuple[list[int], torch.Tensor] | None:
        """The grammar bias of a step with drafts: the constrained sequences' rows, then the rows of their drafts'
        positions (logits rows after the S sampling rows, sequence by sequence)."""
        if not constrained:
            return None
        first_draft_row = np.cumsum([0, *map(len, drafts)])[:-1] + num_sampling
        rows = list(constrained)
        for seq in constrained:
            rows += range(int(first_draft_row[seq]), int(first_draft_row[seq]) + len(drafts[seq]))
        return rows, self.step_grammars.bias(grammars, [drafts[seq] for seq in constrained])

    def step_tokens(
        self, inputs: StepInputs, sampled: SampleResult
    ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """The tokens each sampling sequence gets from this step, with their logprobs: here the one sampled."""
        logprobs = sampled.logprobs
        return [[token] for token in sampled.token_ids], (
            [None if logprob is None else [logprob] for logprob in logprobs]
            if inputs.sampling_needs.logprobs
            else logprobs  # all None
        )

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
            self._padded().load(inputs.buffers, inputs.graph_size, inputs.lora)

    def with_sampled_tokens(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The plan with each PLACEHOLDER replaced by the token this runner sampled for its request: what the
        tensor-parallel ranks, which never sample, are sent under async scheduling."""
        token_ids = tuple(
            [self.batch.seqs[request_id].token_at(start + k) if t == PLACEHOLDER else t for k, t in enumerate(ids)]
            if PLACEHOLDER in ids
            else ids
            for request_id, start, ids in zip(plan.request_ids, plan.num_computed_tokens, plan.token_ids, strict=True)
        )
        return dataclasses.replace(plan, token_ids=token_ids)

    def prepare(self, plan: SchedulerOutput) -> StepInputs | None:
        """Apply the plan's deltas to the runner's state and build the step's inputs; None for an empty step."""
        started = time.perf_counter()
        self.batch.apply(plan, self._grammar_state)
        if self.rope_axes > 1:
            for new in plan.new_requests:
                if new.images:
                    seq = self.batch.seqs[new.request_id]
                    seq.rope = self.model.rope_positions(len(new.prompt_ids), new.images)
        if not plan.request_ids:
            return None
        seq_slots, lora_loads = self.lora.step(plan) if self.lora is not None else (None, [])
        packed = self.batch.pack(plan)
        buffers, num_sampling = packed.buffers, packed.num_sampling
        lora = None
        if seq_slots is not None:
            assert self.lora is not None
            lora = self.lora.batch(np.repeat(seq_slots, plan.num_new_tokens))
        # Rows after the sampling ones: each draft's, then prompt rows, then pooling rows.
        first_other = num_sampling + packed.num_draft_rows
        spans, targets = (
            prompt_rows(
                plan, self.batch.seqs, self.batch.scoring_prompts, packed.cu_q, first_other, buffers.np["logits_rows"]
            )
            if self.batch.scoring_prompts
            else ([], [])
        )
        noncausal = None
        if self.batch.num_with_spans and any(seq.noncausal_spans for seq in packed.seqs):
            starts = packed.seq_lens - np.diff(packed.cu_q)
            noncausal = step_spans([seq.noncausal_spans for seq in packed.seqs], starts, packed.seq_lens)
        pooling = self._pooling_rows(plan, packed, first_other + len(targets)) if self.batch.num_pooling else []
        num_logits = first_other + len(targets) + sum(rows.logits_row is not None for rows in pooling)
        # Not read from `encodings`: under async scheduling the step before, which may encode this step's images,
        # is still running.
        image_rows = _image_rows(plan, packed) if self.takes_images else []
        # A graph's static metadata has no spans, its forward pass returns no hidden states to pool and embeds
        # token ids itself: such a step runs eagerly.
        graph_size = (
            decode_graph_size(self.graph_sizes, len(packed.seqs), packed.max_query_len)
            if noncausal is None and not pooling and not image_rows and self.rope_axes == 1 and not self.has_states
            else None
        )
        if graph_size is None:
            step_ids, metas = self._eager_metas(packed, plan, noncausal)
        else:
            step_ids, metas = self._padded().prepare(packed, graph_size)
        sampling = packed.sampling
        return StepInputs(
            step_ids,
            metas,
            buffers.to_device("logits_rows", num_logits),
            num_sampling,
            spans,
            targets,
            sampling=sampling,
            constrained=[row for row, seq in enumerate(sampling) if seq.grammar is not None]
            if self.batch.num_constrained
            else [],
            placeholders=packed.placeholders,
            sample_positions=packed.sample_positions,
            buffers=buffers,
            sampling_needs=self.batch.sampling_needs,
            drafts=packed.drafts,
            pooling=pooling,
            token_type_ids=self._token_types(plan, packed) if self._takes_token_types else None,
            prepare_seconds=time.perf_counter() - started,
            lora=lora,
            lora_loads=lora_loads,
            rope_positions=self._rope_positions(packed) if self.rope_axes > 1 else None,
            image_rows=image_rows,
            encodes=plan.encodes,
            freed_encodings=plan.freed_encodings,
            graph_size=graph_size,
            states=self._state_step(packed) if self.has_states else None,
        )

    def _state_step(self, packed: PackedStep) -> StateStep:
        """The step's sequences' state slots, each starting afresh when its step starts at position 0."""
        starts = packed.seq_lens - np.diff(packed.cu_q)
        slots = np.fromiter((seq.state_slot for seq in packed.seqs), dtype=np.int64, count=len(packed.seqs))
        return StateStep.of(packed.cu_q, slots, starts == 0, self.device)

    def _pooling_rows(self, plan: SchedulerOutput, packed: PackedStep, offset: int) -> list[PoolingRows]:
        """The step's chunks of pooling sequences; for a pooler that reads logits (yes/no), the last row of each
        prompt's last chunk goes into the logits rows from `offset` on."""
        rows = []
        logits_rows = packed.buffers.np["logits_rows"]
        reads_logits = self.pooler is not None and self.pooler.reads_logits
        for i, (request_id, seq) in enumerate(zip(plan.request_ids, packed.seqs, strict=True)):
            if seq.pooling is None:
                continue
            first, end = int(packed.cu_q[i]), int(packed.cu_q[i + 1])
            ends_prompt = int(packed.seq_lens[i]) == len(seq.prompt_ids)
            logits_row = None
            if reads_logits and ends_prompt:
                logits_rows[offset] = end - 1
                logits_row, offset = offset, offset + 1
            start = plan.num_computed_tokens[i]
            rows.append(PoolingRows(request_id, seq, first, end, start, ends_prompt, logits_row))
        return rows

    def _token_types(self, plan: SchedulerOutput, packed: PackedStep) -> torch.Tensor:
        """[T] each token's segment (0 unless its request gave token type ids), for a model that reads them."""
        types = np.zeros(packed.num_tokens, dtype=np.int64)
        for i, seq in enumerate(packed.seqs):
            if seq.pooling is not None and seq.pooling.token_type_ids:
                start, count = plan.num_computed_tokens[i], plan.num_new_tokens[i]
                types[packed.cu_q[i] : packed.cu_q[i + 1]] = seq.pooling.token_type_ids[start : start + count]
        return torch.from_numpy(types).to(self.device)

    def _eager_metas(
        self, packed: PackedStep, plan: SchedulerOutput, noncausal: tuple[list[Spans], np.ndarray] | None
    ) -> tuple[torch.Tensor, list[StepMetadata]]:
        """The step's token ids on the device (loaded by `run`) and each group's metadata, unpadded."""
        buffers = packed.buffers
        host = buffers.np
        num_seqs, total = len(packed.seqs), packed.num_tokens
        positions = host["positions"][:total]
        dev = {
            name: buffers.to_device(name, n)
            for name, n in (("positions", total), ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs))
        }
        max_seq_len = int(packed.seq_lens.max())
        shared = dict(
            positions=dev["positions"],
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            query_start_loc_host=packed.cu_q.tolist(),
            query_lens_host=list(plan.num_new_tokens),
            seq_lens_host=packed.seq_lens.tolist(),
            max_query_len=packed.max_query_len,
            max_seq_len=max_seq_len,
            page_size=self.page_size,
        )
        widest = -(-max_seq_len // self.page_size)
        metas = []
        for g in range(self.batch.num_groups):
            self.batch.write_tables(host, g, packed.seq_rows, widest, packed.seq_of_token, positions)
            tables = host[f"page_tables{g}"][:num_seqs, :widest]
            spans: dict = {}
            if noncausal is not None:
                # Rare (steps with an image's or an encoder's tokens): staged on their own, not in step buffers.
                intervals = span_intervals(noncausal[1], positions, self.group_windows[g], self.bidirectional)
                spans = dict(
                    noncausal_spans_host=noncausal[0],
                    token_spans=torch.from_numpy(intervals).to(self.device),
                    token_spans_host=intervals,
                )
            meta = StepMetadata(
                slot_mapping=buffers.to_device(f"slot_mapping{g}", total),
                page_tables=buffers.to_device(f"page_tables{g}", num_seqs)[:, :widest],
                page_tables_host=tables,
                **shared,
                **spans,
            )
            self.backend.prepare(meta)
            metas.append(meta)
        return buffers.device["input_ids"][:total], metas

    def use_decode_graphs(self, sizes: tuple[int, ...], capture: Capture) -> None:
        """From now on pad every decode step of up to `sizes[-1]` sequences to the next of `sizes` (ascending) and
        run what `capture` made of the padded forward of that size (on CUDA, the replay of its graph;
        engine/execution/cuda_graphs.py). Called before the first step (engine/execution/graph_inputs.py)."""
        if self.batch.seqs:
            raise RuntimeError("decode graphs are set up before the first step")
        lora = self.lora
        adapters = (
            None if lora is None else StaticAdapters(sizes[-1], lora.num_slots, lora.rank, lora.dtype, self.device)
        )
        self.padded_decode = PaddedDecode(
            sizes,
            capture,
            lambda ids, metas, batch: self._model_forward(ids, metas, lora=batch),
            self.batch,
            self.backend,
            self.scratch_pages,
            self._max_rows,
            adapters,
        )

    def _padded(self) -> PaddedDecode:
        """The padded decode steps, which a step with a graph size has."""
        if self.padded_decode is None:
            raise RuntimeError("a step padded to a graph size, yet no decode graphs are set up")
        return self.padded_decode

    def _grammar_state(self, new: NewRequest) -> GrammarState | None:
        """A constrained request's grammar state; none on a rank that does not sample."""
        return self.step_grammars.state_of(new) if self.samples else None

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """One forward pass over the packed row; logits (float32) only at the sampling sequences' last tokens (and
        the prompt rows scored), None on a tensor-parallel rank other than 0."""
        return self.forward_and_pool(inputs)[0]

    @torch.inference_mode()
    def forward_and_pool(self, inputs: StepInputs) -> tuple[torch.Tensor | None, dict[str, list[float]]]:
        """`forward`'s logits, and the vectors of the pooling sequences whose prompt this step finished (on rank 0
        only: the hidden states are the same on every rank)."""
        self.load_inputs(inputs)
        if inputs.lora_loads:
            assert self.lora is not None
            self.lora.load(inputs.lora_loads)
        if inputs.freed_encodings or inputs.encodes:
            self._update_encodings(inputs.freed_encodings, inputs.encodes)
        if inputs.graph_size is not None:
            hidden = self._padded().replay(inputs.graph_size, adapted=inputs.lora is not None)
        else:
            embeds = self._embed_with_images(inputs.input_ids, inputs.image_rows) if inputs.image_rows else None
            hidden = self._model_forward(
                inputs.input_ids,
                inputs.metas,
                inputs.token_type_ids,
                inputs.lora,
                embeds,
                inputs.rope_positions,
                inputs.states,
            )
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        pooled = self._pool(hidden, logits, inputs.pooling) if inputs.pooling and logits is not None else {}
        return logits, pooled

    def _rope_positions(self, packed: PackedStep) -> torch.Tensor:
        """[axes, T] rotary positions: a token's own position on every axis, except where a sequence with images
        has its own (its prompt's table, then positions past the prompt shifted by its offset)."""
        total = packed.num_tokens
        positions = packed.buffers.np["positions"][:total]
        rope = np.repeat(positions[None, :], self.rope_axes, axis=0)
        for i, seq in enumerate(packed.seqs):
            if seq.rope is None:
                continue
            table, offset = seq.rope
            first, end = int(packed.cu_q[i]), int(packed.cu_q[i + 1])
            own = positions[first:end]
            in_prompt = own < table.shape[1]
            rope[:, first:end] = np.where(in_prompt, table[:, np.minimum(own, table.shape[1] - 1)], own + offset)
        return torch.from_numpy(rope).to(self.device)

    def _update_encodings(self, freed: tuple[str, ...], encodes: tuple[ImageInput, ...]) -> None:
        """Drop the encodings the plan frees, then encode its images (one vision call for all of them)."""
        for content_hash in freed:
            del self.encodings[content_hash]
        if encodes:
            for image, embeddings in zip(encodes, self.model.encode_images(list(encodes)), strict=True):
                self.encodings[image.content_hash] = embeddings

    def _embed_with_images(self, input_ids: torch.Tensor, image_rows: list[tuple[int, str, int, int]]) -> torch.Tensor:
        """[T, hidden]: the token embeddings, with each image token's row its image's embedding."""
        embeds = self.model.embed_input_ids(input_ids)
        for row, content_hash, first, count in image_rows:
            embeds[row : row + count] = self.encodings[content_hash][first : first + count]
        return embeds

    def _pool(self, hidden: torch.Tensor, logits: torch.Tensor, chunks: list[PoolingRows]) -> dict[str, list[float]]:
        """Each chunk's hidden states into its sequence's pooling state; the vectors of those whose prompt ends."""
        pooler = self.pooler
        if pooler is None:
            raise RuntimeError("a pooling request reached a runner whose model does not pool")
        done = [chunk for chunk in chunks if chunk.ends_prompt]
        if pooler.reads_logits:
            vectors = pooler.yes_no(logits[[chunk.logits_row for chunk in done]]) if done else None
        else:
            for chunk in chunks:
                assert chunk.seq.pool is not None
                pooler.accumulate(chunk.seq.pool, hidden[chunk.first : chunk.end], chunk.start, chunk.ends_prompt)
            vectors = pooler.finish(torch.stack([chunk.seq.pool.pooled for chunk in done])) if done else None  # type: ignore[union-attr,misc]
        if vectors is None:
            return {}
        return dict(zip((chunk.request_id for chunk in done), vectors.tolist(), strict=True))

    def _model_forward(
        self,
        input_ids: torch.Tensor,
        metas: list[StepMetadata],
        token_type_ids: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
        inputs_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
        states: StateStep | None = None,
    ) -> torch.Tensor:
        """The model up to the final norm, inside the step's context for the attention layers
        (engine/attention/context.py): each group's metadata, per layer; for the adapted linears, `lora`.
        `inputs_embeds` `[T, hidden]`: the rows to run instead of `input_ids`' embeddings (image tokens').
        `rope_positions` `[axes, T]`: the rotary positions of a model with several axes (else the tokens').
        `states`: a recurrent model's state slots for the step."""
        layer_metas = [metas[g] for g in self.group_of_layer]
        context = StepContext(self.backend, layer_metas, self.sliding_windows, self.kv_caches, lora=lora, states=states)
        with step_context(context):
            if token_type_ids is not None:
                return self.model(input_ids, metas[0].positions, self.kv_caches, token_type_ids=token_type_ids)
            positions = metas[0].positions if rope_positions is None else rope_positions
            if inputs_embeds is not None:
                return self.model(input_ids, positions, self.kv_caches, inputs_embeds)
            return self.model(input_ids, positions, self.kv_caches)


def _image_rows(plan: SchedulerOutput, packed: PackedStep) -> list[tuple[int, str, int, int]]:
    """(first packed row, content hash, first embedding, count) for each stretch of image tokens the step
    computes, in packing order."""
    rows = []
    for i, seq in enumerate(packed.seqs):
        if not seq.images:
            continue
        start, first_row = plan.num_computed_tokens[i], int(packed.cu_q[i])
        end = start + plan.num_new_tokens[i]
        for image in seq.images:
            lo, hi = max(start, image.offset), min(end, image.end)
            if lo < hi:
                rows.append((first_row + lo - start, image.content_hash, lo - image.offset, hi - lo))
    return rows
