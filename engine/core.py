"""The engine step: drain nothing, decide, run, sample, emit. Both drivers (the in-process manager and the
server's engine process) call the same `step`.

One step, one direction: scheduler decides (which requests, how many tokens each) -> runner packs and runs the
model -> sampler picks next tokens -> core turns them into per-request deltas.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import torch

from engine.attention import select_backend
from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.kv_groups import GroupLayout, KVCacheGroups, group_layers, sliding_pool_pages
from engine.loader import LoadedModel, load_model
from engine.request import (
    FinishReason,
    QueueFull,
    Request,
    RequestRejected,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_name = os.path.basename(os.path.normpath(config.model))
        device_type = (
            "cuda"
            if config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
            else "cpu"
        )
        if device_type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        backend = select_backend(config.attention_backend, device_type, config.page_size)
        loaded = load_model(config, backend)
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.device = loaded.device
        layouts = group_layers(loaded.model.sliding_windows)
        pool_sizes = self._pool_sizes(layouts, loaded)
        self.block_manager = KVCacheGroups(
            layouts,
            [
                BlockManager(
                    pages,
                    config.page_size,
                    enable_prefix_caching=config.enable_prefix_caching,
                    sliding_window=layout.window,
                    debug_checks=config.debug_checks,
                )
                for layout, pages in zip(layouts, pool_sizes, strict=True)
            ],
        )
        num_blocks = pool_sizes[0]
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(
            loaded.model,
            backend,
            layouts,
            pool_sizes,
            config.page_size,
            config.max_batch_tokens,
            config.max_num_seqs,
            self.max_model_len,
            loaded.device,
            loaded.dtype,
        )
        self.sampler = Sampler(loaded.hf_config.vocab_size, loaded.device, config.seed)
        self._pending_aborts: list[StepOutput] = []
        self._num_steps = 0
        self._last_step_tokens = 0
        logger.info(
            "engine ready: %s (%s, %s, %s backend), %d pages of %d tokens, max_model_len %d",
            self.model_name,
            "native" if loaded.native else "transformers",
            loaded.dtype,
            backend.name,
            num_blocks,
            config.page_size,
            self.max_model_len,
        )

    def _pool_sizes(self, layouts: list[GroupLayout], loaded: LoadedModel) -> list[int]:
        """Pages of each group's pool: `num_blocks` (or what the memory budget allows) for the primary group, and
        for a secondary (sliding) group no more than all running sequences' windows can fill."""
        config = self.config
        layer_page = ModelRunner.kv_bytes_per_layer_page(loaded.model, config.page_size, loaded.dtype)
        caps = []
        for layout in layouts[1:]:
            assert layout.window is not None, "only the primary group can be full attention"
            caps.append(
                sliding_pool_pages(layout.window, config.page_size, config.max_num_seqs, config.max_batch_tokens)
            )
        if config.num_blocks:
            primary = config.num_blocks
        else:
            if loaded.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(loaded.device)
                budget = free * config.max_memory_percent
            else:
                budget = config.cpu_kv_cache_gib * 2**30
            secondary = sum(
                cap * len(layout.layers) * layer_page for cap, layout in zip(caps, layouts[1:], strict=True)
            )
            primary = int((budget - secondary) // (len(layouts[0].layers) * layer_page))
            if caps and primary < max(caps):
                # Too small a budget for the sliding pools' caps: split it evenly, every pool the same pages.
                primary = int(budget // (len(loaded.model.sliding_windows) * layer_page))
            primary = max(1, primary)
        return [primary] + [min(primary, cap) for cap in caps]

    # -- requests in ---------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", code="invalid_prompt")
        if request_id in self.scheduler.waiting or request_id in self.scheduler.running:
            raise RequestRejected(f"request id {request_id!r} is already in flight", code="duplicate_request_id")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{total} ({len(prompt_ids)} in the prompt + {params.max_new_tokens} to generate)",
                code="context_length_exceeded",
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise RequestRejected(
                f"the request needs {total} tokens of KV cache but the whole cache holds "
                f"{self.block_manager.num_blocks * self.config.page_size}",
                code="context_length_exceeded",
            )
        vocab = self.hf_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", code="invalid_prompt")
        if self.config.max_queue_size and len(self.scheduler.waiting) >= self.config.max_queue_size:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are already waiting")
        eos = frozenset(params.eos_token_ids) if params.eos_token_ids is not None else self.eos_token_ids
        request = Request(request_id, list(prompt_ids), params, eos, generator_seed=self._seed_for(request_id))
        self.scheduler.add(request)

    def _seed_for(self, request_id: str) -> int:
        """A request without a seed of its own samples from one derived from the engine seed and its id."""
        digest = hashlib.blake2b(f"{self.config.seed}:{request_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**62 - 1)

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return
        self._pending_aborts.append(self._delta(request, [], None, None))

    # -- the step --------------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending_aborts)

    def step(self) -> list[StepOutput]:
        outputs, self._pending_aborts = self._pending_aborts, []
        batch = self.scheduler.schedule()
        self._last_step_tokens = batch.total_tokens
        if not batch.requests:
            return outputs
        self._num_steps += 1
        # A sequence samples when this step computes its last known token (a finished prefill or a decode).
        sampling = [
            r.num_computed_tokens + n == r.num_tokens for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)
        ]
        tables = self.block_manager.block_tables([r.request_id for r in batch.requests])
        inputs = self.runner.prepare(batch.requests, batch.num_new_tokens, tables, sampling)
        logits = self.runner.run(inputs)
        samplers = [r for r, s in zip(batch.requests, sampling, strict=True) if s]
        result = self.sampler(logits, samplers)
        self.scheduler.advance(batch)
        now = time.monotonic()
        for request, token, logprob in zip(samplers, result.token_ids, result.logprobs, strict=True):
            request.output_ids.append(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                request.finish_reason = reason
                self.scheduler.finish(request, reason)
            timestamps = [now] if request.params.record_timestamps else None
            outputs.append(self._delta(request, [token], logprob, timestamps))
        return outputs

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        generated = len(request.output_ids)
        if generated >= params.min_new_tokens and (
            (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return FinishReason.STOP
        if generated >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _delta(
        request: Request, tokens: list[int], logprob: TokenLogprob | None, timestamps: list[float] | None
    ) -> StepOutput:
        first = len(request.output_ids) == len(tokens)
        queue = None
        if first and request.first_scheduled_time is not None:
            queue = request.first_scheduled_time - request.arrival_time
        return StepOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=request.finish_reason,
            new_logprobs=[logprob] if logprob is not None else None,
            new_timestamps=timestamps,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_seconds=queue,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            last_step_tokens=self._last_step_tokens,
        )

    def is_idle_and_clean(self) -> bool:
        """True when nothing is in flight and every page is free or merely cached (tests and debug checks)."""
        return not self.has_unfinished() and self.block_manager.all_free()
