"""The engine step: the scheduler plans, the runner executes, the scheduler applies the result.

Every driver (generate_batch, the background manager, the server's engine process) runs this same `step`
through the one loop in `engine/core/driver.py`.

With `async_scheduling` the runner executes on a thread of its own, one step behind the scheduler: while it runs
step N, this thread plans step N+1 and prepares its inputs (`ModelRunner.prepare`, into the buffer set N does not
use), then applies step N's result and hands over N+1. A step keeps what it reads from its own prepare, so nothing
is changed under it; the torch ops release the GIL. With tensor parallelism N+1 is prepared on the runner's thread
after N, since its plan goes to the other ranks with the tokens N sampled filled in.

A request with structured output joins the scheduler only once its grammar compiled (on the compiler's threads,
engine/core/structured.py); until then it waits here, counted as waiting, while the other requests keep stepping. The
scheduler never knows.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, EngineStartupError, SpeculativeConfig
from engine.core.kv_cache import KVCacheManager
from engine.core.observer import QueuedRequest, StepObserver, StepRecord
from engine.core.page_pool import PagePool
from engine.core.request import (
    ExtraKey,
    LoRARequest,
    PoolingParams,
    QueueFull,
    Request,
    RequestRejected,
    SamplingParams,
    StepOutput,
)
from engine.core.scheduler import Scheduler
from engine.core.state_slots import StateSlots
from engine.core.stats import EngineStats
from engine.core.step import ModelRunnerOutput, SchedulerOutput
from engine.core.structured import CompiledGrammar, GrammarCompiler
from engine.distributed.parallel import CollectiveFailed, TensorParallel, init_tensor_parallel, with_rendezvous
from engine.distributed.worker import Workers
from engine.execution.cuda_graphs import CaptureReport
from engine.execution.runner import ModelRunner
from engine.execution.startup import start_runner
from engine.lora.adapter import AdapterError, AdapterSpec, read_adapter
from engine.models.loader import LoadedModel, load_model, model_config, weight_bytes
from engine.models.support import dequantized_at_load
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput
from engine.speculative.draft_model import DraftModelDrafts
from engine.speculative.speculator import Speculator

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler, KV-cache manager and runner wired together, with request intake and statistics.

    `loaded` is a model already loaded for `config` (the overhead benchmark passes one whose forward pass costs
    nothing); by default the model `config` names is loaded. `observers` see one `StepRecord` per step. `grammars`
    compiles structured outputs; by default one for the model directory's tokenizer. `runner_class` builds this
    rank's runner: ModelRunner, or a subclass that changes what a step returns (tests script several tokens a step);
    the other tensor-parallel ranks, which never sample, run ModelRunner.

    With `config.parallel.tensor_parallel_size` > 1 it starts this node's other ranks (engine/distributed/worker.py)
    and is rank 0, the driver: each step's plan goes to every rank, and sampling (grammars included) happens here
    only. `close()`, or leaving a `with` block, stops the ranks.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        observers: Iterable[StepObserver] = (),
        grammars: GrammarCompiler | None = None,
        runner_class: type[ModelRunner] = ModelRunner,
    ) -> None:
        self.model_name = os.path.basename(os.path.normpath(config.model.path))
        self.tensor_parallel: TensorParallel | None = None
        """This process's rank 0 of the tensor-parallel group; None without tensor parallelism."""
        self._workers: Workers | None = None
        if config.parallel.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a model loaded beforehand cannot be sharded: tensor parallelism loads its own")
            config.parallel.check_layout()
            config = with_rendezvous(config)
            model_config(config)  # refuse what cannot be sharded before any rank starts
            self._workers = Workers(config, range(1, config.parallel.ranks_per_node))
        self.config = config
        try:
            if self._workers is not None:
                self.tensor_parallel = init_tensor_parallel(config, rank=0)
            self._build(
                config, load_model(config, self.tensor_parallel) if loaded is None else loaded, grammars, runner_class
            )
        except BaseException:
            self._release(stopped=False)  # the other ranks may be anywhere in their start-up: no stop for them
            raise
        self.observers: list[StepObserver] = list(observers)
        self._num_steps = 0
        self._last_step_tokens = 0

    def _build(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        grammars: GrammarCompiler | None,
        runner_class: type[ModelRunner],
    ) -> None:
        self.grammars = grammars or GrammarCompiler(
            config.model.path, vocab_size=loaded.hf_config.vocab_size, eos_token_ids=loaded.eos_token_ids
        )
        started = start_runner(config, loaded, self.tensor_parallel, self.grammars, runner_class)
        self.runner = started.runner
        self.cuda_graphs: CaptureReport | None = started.cuda_graphs
        """What was captured (sizes, seconds, memory); None when every step runs eagerly."""
        loaded, layouts, pages = started.loaded, started.layouts, started.pages
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.device = loaded.device
        self.weight_bytes = weight_bytes(loaded.model)
        """This rank's weights as stored (quantized codes and scales under --quantization)."""
        self.pooling = loaded.pooler.config if loaded.pooler is not None else None
        """What the model pools (engine/pooling/config.py); None for a model that only generates."""
        stored = loaded.stored
        self.quantization = config.model.quantization if stored is None else stored.runs_as
        """The scheme whose kernels run the linear weights: --quantization's, or the quantized checkpoint's."""
        self.checkpoint_quantization = None if stored is None else (stored.format, stored.description)
        """(format, its weights in words) of a checkpoint whose weights are stored quantized; None otherwise."""
        if dequantized_at_load(loaded.hf_config):
            dtype = str(loaded.dtype).removeprefix("torch.")
            self.checkpoint_quantization = (
                "mxfp4", f"experts in 4-bit e2m1 with an exponent per 32 weights, dequantized to {dtype} at load"
            )  # fmt: skip
        self.kv_cache_dtype = str(self.runner.kv_caches[0][0].dtype).removeprefix("torch.")
        """What the KV cache stores K and V in: `float8_e4m3fn` under --kv-cache-dtype fp8, else the model's dtype
        (`bfloat16`, `float32`, ...), for the front end to report."""
        states = StateSlots(started.state_slots) if started.state_slots else None
        prefix_caching = config.cache.enable_prefix_caching and states is None
        if states is not None and config.cache.enable_prefix_caching:
            logger.info(
                "prefix caching is off for %s: its recurrent layers' state at the end of a shared prefix is not kept, "
                "so every prompt is computed from its first token",
                self.hf_config.model_type,
            )
        pools = [
            PagePool(
                n,
                config.cache.page_size,
                enable_prefix_caching=prefix_caching,
                sliding_window=layout.window,
                debug_checks=config.cache.debug_checks,
            )
            for layout, n in zip(layouts, pages, strict=True)
        ]
        self.kv_cache = KVCacheManager(layouts, pools, states)
        self.encoder_cache = EncoderCache(config.cache.encoder_cache_tokens) if loaded.takes_images else None
        """An image model's account of the image encodings the runner holds; None for a text model."""
        self._images_received = 0
        self._bidirectional_images = bool(getattr(loaded.model, "bidirectional_images", False))
        """An image's tokens attend to each other both ways (Gemma 3): each image is a non-causal span."""
        self.max_images = config.model.max_images if self.encoder_cache is not None else 0
        """Images one prompt may hold (0: the model takes none, or is served text-only)."""
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, self.max_model_len,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            encoder_cache=self.encoder_cache,
        )  # fmt: skip
        speculative = config.scheduler.speculative_config
        self._draft_engine: EngineCore | None = None
        """The draft model's engine (--speculative-config's draft_model); None otherwise."""
        if speculative is not None and speculative.method == "draft_model":
            self._draft_engine = self._start_draft_engine(config, speculative)
        self.speculator = Speculator(
            speculative, DraftModelDrafts(self._draft_engine) if self._draft_engine is not None else None
        )
        """Drafts for each step's decodes: from --speculative-config's source, and from requests' predictions."""
        self._awaiting_grammar: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        """Constrained requests whose grammar is still compiling, in arrival order."""
        self._settled: list[tuple[str, RequestRejected | None]] = []
        """Requests that stopped waiting for their grammar since `settle_grammars` last ran."""
        self._runner_thread: ThreadPoolExecutor | None = None
        if config.scheduler.async_scheduling:
            # torch's thread count is per thread: the runner's thread gets the one the loader set here.
            self._runner_thread = ThreadPoolExecutor(
                1, "ferry-runner", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
        self._in_flight: tuple[_Planned, Future[ModelRunnerOutput]] | None = None
        """The step the runner's thread executes now (async scheduling)."""
        logger.info(
            "engine ready: %s (%s, %s, %s backend, tensor-parallel size %d), %d pages of %d tokens, max_model_len %d",
            self.model_name,
            "native" if loaded.native else "transformers",
            loaded.dtype,
            loaded.backend.name,
            config.parallel.tensor_parallel_size,
            pages[0],
            config.cache.page_size,
            self.max_model_len,
        )

    def _start_draft_engine(self, config: EngineConfig, speculative: SpeculativeConfig) -> EngineCore:
        """The draft model on one rank, beside this one: as many pages and positions as the served model has, so
        that whatever this engine takes the draft can take too; refused unless it shares the tokenizer."""
        assert speculative.model is not None
        draft_config = config.replace(
            model=speculative.model,
            speculative_config=None,
            async_scheduling=False,
            max_queue_size=0,
            num_pages=self.kv_cache.num_pages,
            max_model_len=self.max_model_len,
            tensor_parallel_size=1,
            nnodes=1,
            quantization="none",
        )
        draft = EngineCore(draft_config)
        problem = _vocabulary_difference(config.model.path, speculative.model, self.hf_config, draft.hf_config)
        if problem is not None:
            draft.close()
            raise EngineStartupError(
                f"the draft model {speculative.model} cannot draft for {self.model_name}: {problem} (--speculative-"
                "config's model must share the served model's tokenizer)"
            )
        return draft

    # -- requests in ---------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        batch: bool = False,
        pooling: PoolingParams | None = None,
        prediction: tuple[int, ...] = (),
        lora: LoRARequest | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> bool:
        """Take a request, or raise RequestRejected / QueueFull. True when it joined the scheduler; False when it
        waits for its grammar to compile, and `settle_grammars` later tells whether it joined or was refused.
        `priority` (lower runs first) needs the `priority` scheduling policy. `batch`: a line of the Batch API,
        which waits behind every interactive request under either policy. `pooling`: pool the prompt instead
        of generating (`params` is not read then). `prediction`: the output the client expects, drafted from
        (OpenAI's Predicted Outputs). `lora`: the adapter to run with (--enable-lora). `images`: the processed
        images among the prompt's tokens (an image model's)."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", code="invalid_prompt")
        if (
            request_id in self.scheduler.waiting
            or request_id in self.scheduler.running
            or request_id in self._awaiting_grammar
        ):
            raise RequestRejected(f"request id {request_id!r} is already in flight", code="duplicate_request_id")
        if pooling is not None:
            params = SamplingParams(max_new_tokens=1)
            self._check_pooling(prompt_ids, pooling)
        elif self.pooling is not None and not self.pooling.generates:
            raise RequestRejected(
                f"{self.model_name} is a pooling model ({self.pooling.kind}): it makes embeddings or scores and "
                "does not generate",
                code="model_does_not_generate",
            )
        total = len(prompt_ids) + (0 if pooling is not None else params.max_new_tokens)
        if total > self.max_model_len:
            wanted = (
                f"{total} tokens"
                if pooling is not None
                else f"{total} ({len(prompt_ids)} in the prompt + {params.max_new_tokens} to generate)"
            )
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs {wanted}",
                code="context_length_exceeded",
            )
        if not self.kv_cache.fits(total):
            raise RequestRejected(
                f"the request needs {total} tokens of KV cache but the whole cache holds "
                f"{self.kv_cache.num_pages * self.config.cache.page_size}",
                code="context_length_exceeded",
            )
        vocab = self.hf_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", code="invalid_prompt")
        if prediction and (min(prediction) < 0 or max(prediction) >= vocab):
            raise RequestRejected(f"prediction token ids must be in [0, {vocab})", code="invalid_prediction")
        if any(not 0 <= token < vocab for token, _ in params.logit_bias):
            raise RequestRejected(f"logit_bias token ids must be in [0, {vocab})", code="invalid_logit_bias")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise RequestRejected(
                f"priority {priority} was given, but the server schedules first come, first served: start it with "
                "--scheduling-policy priority to use priorities",
                code="invalid_priority",
            )
        num_waiting = self._num_waiting
        if self.config.scheduler.max_queue_size and num_waiting >= self.config.scheduler.max_queue_size:
            raise QueueFull(f"{num_waiting} requests are already waiting")
        eos = frozenset(params.eos_token_ids) if params.eos_token_ids is not None else self.eos_token_ids
        request = Request(
            request_id,
            list(prompt_ids),
            params,
            eos,
            generator_seed=self._seed_for(request_id),
            priority=priority,
            batch=batch,
        )
        request.predicted_ids = tuple(prediction)
        if lora is not None:
            self._check_lora(lora, pooling)
            request.lora = lora
            request.extra_keys = (*request.extra_keys, lora.extra_key)
        if images:
            self._check_images(len(prompt_ids), images, pooling)
            request.images = tuple(images)
            self._images_received += len(images)
            if self._bidirectional_images:
                request.noncausal_spans = tuple((image.offset, image.end) for image in images)
            # An image's tokens are placeholders: its pages' K/V depend on its content, which its hash names.
            keys = (ExtraKey(image.offset, image.end, ("image", image.content_hash)) for image in images)
            request.extra_keys = (*request.extra_keys, *keys)
        if pooling is not None:
            request.pooling = pooling
            if self.pooling is not None and self.pooling.bidirectional:
                # An encoder's input attends in both directions: one span, computed in one step.
                request.noncausal_spans = ((0, len(prompt_ids)),)
        if params.structured_output is not None:
            end_tokens = eos | frozenset(params.stop_token_ids)
            if not any(0 <= token < vocab for token in end_tokens):
                raise RequestRejected(
                    "structured output needs a token to end with once the constraint is satisfied: the request "
                    "has no EOS or stop token id in the vocabulary",
                    code="invalid_structured_output",
                )
            grammar = self.grammars.submit(params.structured_output)
            if not grammar.done():
                self._awaiting_grammar[request_id] = (request, grammar)
                return False
            _raise_if_failed(grammar)
        self._admit(request)
        return True

    def _check_images(self, num_prompt_tokens: int, images: tuple[ImageInput, ...], pooling: object) -> None:
        limit = self.max_images
        if self.encoder_cache is None or limit == 0:
            why = (
                "a text model"
                if self.encoder_cache is None
                else "it is served text-only (--limit-mm-per-prompt image=0)"
            )
            raise RequestRejected(f"{self.model_name} takes no images: {why}", code="images_not_supported")
        if pooling is not None:
            raise RequestRejected("images are for generation: a pooling request takes text", code="invalid_prompt")
        if len(images) > limit:
            raise RequestRejected(
                f"{len(images)} images in one prompt: at most {limit} are allowed (--limit-mm-per-prompt)",
                code="too_many_images",
            )
        budget = self.config.scheduler.max_batch_tokens
        end = 0
        for image in images:
            if image.offset < end or image.end > num_prompt_tokens:
                raise RequestRejected(
                    f"an image's tokens [{image.offset}, {image.end}) overlap another's or leave the prompt "
                    f"({num_prompt_tokens} tokens)",
                    code="invalid_prompt",
                )
            end = image.end
            # A step encodes an image whole, beside at least one of its tokens; where its tokens are a non-causal
            # span (Gemma 3), beside all of them.
            needed = 2 * image.length if self._bidirectional_images else image.length + 1
            if needed > budget or image.length > self.encoder_cache.capacity:
                beside = "all its tokens" if self._bidirectional_images else "at least one token"
                raise RequestRejected(
                    f"an image of {image.length} tokens: a step encodes an image whole, beside {beside}, within "
                    f"--max-batch-tokens ({budget}), and the encoder cache (--encoder-cache-tokens) holds "
                    f"{self.encoder_cache.capacity}",
                    code="image_too_large",
                )

    def _check_pooling(self, prompt_ids: list[int], pooling: PoolingParams) -> None:
        if self.pooling is None:
            raise RequestRejected(
                f"{self.model_name} generates and does not pool: it makes no embeddings or scores (a pooling model "
                "is served with --runner pooling; a causal LM scores yes/no with --reranker-tokens)",
                code="model_does_not_pool",
            )
        if pooling.token_type_ids and len(pooling.token_type_ids) != len(prompt_ids):
            raise RequestRejected(
                f"{len(pooling.token_type_ids)} token type ids for {len(prompt_ids)} prompt tokens",
                code="invalid_prompt",
            )
        # A model without segments (no `type_vocab_size`: ModernBERT, decoders) never reads them.
        num_types = getattr(self.hf_config, "type_vocab_size", None)
        if num_types and pooling.token_type_ids and not all(0 <= t < num_types for t in pooling.token_type_ids):
            raise RequestRejected(f"token type ids must be in [0, {num_types})", code="invalid_prompt")
        budget = self.config.scheduler.max_batch_tokens
        if self.pooling.bidirectional and len(prompt_ids) > budget:
            raise RequestRejected(
                f"an encoder computes an input in one step, and this one has {len(prompt_ids)} tokens where a step "
                f"holds {budget} (--max-batch-tokens)",
                code="context_length_exceeded",
            )

    def _check_lora(self, lora: LoRARequest, pooling: PoolingParams | None) -> None:
        """Refuse an adapter the engine cannot run: LoRA off, a pooling request, or files that do not fit (read
        once per loading of an adapter: the API process checked them already, and they may have changed since)."""
        if not self.config.lora.enable_lora:
            raise RequestRejected(
                f"the request asks for LoRA adapter {lora.name!r}, but the server runs without --enable-lora",
                code="lora_not_enabled",
            )
        if pooling is not None:
            raise RequestRejected("LoRA adapters generate; pooling requests run on the base model", code="invalid_lora")
        try:
            self._lora_spec(lora.lora_id, lora.path)
        except AdapterError as error:
            raise RequestRejected(str(error), code="invalid_lora") from error

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one engine per process; ids are unique per loading
    def _lora_spec(self, lora_id: int, path: str) -> AdapterSpec:
        return read_adapter(path, self.hf_config, self.config.lora.max_lora_rank)

    def _admit(self, request: Request) -> None:
        """Hand a taken request to the scheduler, and to the speculator (a prediction, a source's last look). A
        model with recurrent state takes no drafts (a rejected one would already have advanced the state): its
        requests' predictions are not drafted from, and its output is what it would be without them."""
        if self.kv_cache.states is None:
            self.speculator.add(request)
        self.scheduler.add(request)

    @property
    def num_awaiting_grammar(self) -> int:
        return len(self._awaiting_grammar)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a pending grammar is ready, at most `timeout` seconds (the loop calls it when idle)."""
        futures = [grammar for _, grammar in self._awaiting_grammar.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def settle_grammars(self) -> list[tuple[str, RequestRejected | None]]:
        """Requests that stopped waiting for their grammar since the last call: None for each that joined the
        scheduler, the error for each refused (an invalid or unsupported constraint; it never ran)."""
        for request_id, (request, grammar) in list(self._awaiting_grammar.items()):
            if not grammar.done():
                continue
            del self._awaiting_grammar[request_id]
            try:
                _raise_if_failed(grammar)
            except RequestRejected as exc:
                self._settled.append((request_id, exc))
            else:
                self._admit(request)
                self._settled.append((request_id, None))
        settled, self._settled = self._settled, []
        return settled

    @property
    def _num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._awaiting_grammar)

    def _seed_for(self, request_id: str) -> int:
        """A request without a seed of its own samples from one derived from the engine seed and its id."""
        digest = hashlib.blake2b(f"{self.config.scheduler.seed}:{request_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**62 - 1)

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        """End a request now (idempotent); the next step emits its final output, carrying `error` if given."""
        held = self._awaiting_grammar.pop(request_id, None)
        if held is not None:
            # Taken, then ended before its grammar was ready: it finishes like any abort of a waiting request.
            self._admit(held[0])
            self._settled.append((request_id, None))
        self.scheduler.abort(request_id, error)

    # -- the step --------------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Requests not finished, or a step still in flight (its result is applied by the next `step`)."""
        return self.scheduler.has_unfinished or self._in_flight is not None

    def step(self) -> list[StepOutput]:
        """One step's outputs: plan, execute, apply; with async scheduling, apply the step in flight and start
        the one planned while it ran."""
        started = time.perf_counter()
        if self._runner_thread is not None:
            outputs = self._step_ahead(self._runner_thread)
        else:
            planned = self._schedule()
            result = self._execute(planned.plan)
            outputs = self._apply(planned, result, time.perf_counter())
        speculator = self.speculator
        drafting = speculator.take_drafting_seconds()
        if speculator.active and self._last_step_tokens:
            # The whole step as the engine's loop lives it (planning, the forward pass, applying): what a token made
            # by a draft saves. Drafting is left out: its cost is weighed a drafted token at a time (gate.py).
            speculator.cost.record(self._last_step_tokens, time.perf_counter() - started - drafting)
        return outputs

    def _schedule(self) -> _Planned:
        """The next plan, with the drafts the speculator proposes for its decodes."""
        started = time.perf_counter()
        # What the plan chose from, for observers only: copying the queue each step costs O(waiting).
        queue = tuple(QueuedRequest(r.request_id, r.batch) for r in self.scheduler.waiting) if self.observers else ()
        speculator = self.speculator
        running = self.scheduler.running
        if not speculator.active or not running:
            plan = self.scheduler.schedule()
        else:
            drafts = speculator.propose(running)
            plan = self.scheduler.schedule(drafts, speculator.hold(running) if self._runner_thread is not None else ())
        return _Planned(plan, queue, time.perf_counter() - started)

    def _execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """The plan to every tensor-parallel rank, then this rank's part (on the runner's thread when async)."""
        if self.tensor_parallel is not None:
            # Planned ahead, the plan may hold tokens only this rank sampled (the step before has run by now): they
            # are filled in once, and every rank executes the very same plan.
            if self._runner_thread is not None:
                plan = self.runner.with_sampled_tokens(plan)
            self.tensor_parallel.broadcast_plan(plan)
        return self.runner.execute(plan)

    def _step_ahead(self, runner_thread: ThreadPoolExecutor) -> list[StepOutput]:
        if self._in_flight is None:
            first = self._schedule()
            self._in_flight = (first, runner_thread.submit(self._ahead(first.plan)))
        planned, running = self._in_flight
        following = self._schedule()
        execute_following = self._ahead(following.plan)
        outputs = self._apply(planned, running.result(), time.perf_counter())
        if self.scheduler.has_unfinished:
            self._in_flight = (following, runner_thread.submit(execute_following))
        else:
            # Every request is done, and whatever `following` computes is for requests that stopped after it was
            # planned: it runs here and now, its tokens dropped, so that the engine rests with no step in flight.
            outputs += self.scheduler.update(following.plan, execute_following())
            self._in_flight = None
        return outputs

    def _ahead(self, plan: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """What executes a step planned ahead: prepared here and now, while the step before it runs; with tensor
        parallelism prepared where it runs, after that step (its plan is sent with the tokens it sampled)."""
        if self.tensor_parallel is not None:
            return functools.partial(self._execute, plan)
        return functools.partial(self.runner.run, self.runner.prepare(plan))

    def _apply(self, planned: _Planned, result: ModelRunnerOutput, executed: float) -> list[StepOutput]:
        plan = planned.plan
        outputs = self.scheduler.update(plan, result)
        if self.speculator.active:
            self.speculator.observe(plan, result)
            self.speculator.finish(outputs)
        self._last_step_tokens = plan.num_tokens
        self._num_steps += bool(plan.request_ids)
        if self.observers:
            update_seconds = time.perf_counter() - executed
            record = StepRecord(plan, result, outputs, planned.queue, planned.seconds, update_seconds)
            for observer in self.observers:
                observer.on_step(record)
        return outputs

    def keep_alive(self) -> None:
        """Called by the loop while the engine idles: with tensor parallelism an empty plan tells the other ranks
        the driver is alive (they would take a silence of distributed_timeout for a dead driver) and finds out
        whether they are (at most every KEEP_ALIVE_INTERVAL_S); nothing without it."""
        tp = self.tensor_parallel
        if tp is not None and time.monotonic() - tp.last_broadcast >= KEEP_ALIVE_INTERVAL_S:
            tp.broadcast_plan(_IDLE_PLAN)

    def close(self) -> None:
        """Wait for the step in flight (async scheduling), stop the other tensor-parallel ranks and leave their
        group; the engine cannot step afterwards. Idempotent; after a failed collective the workers are killed
        instead."""
        if self._runner_thread is not None:
            if self._in_flight is not None:
                planned, running = self._in_flight
                self._in_flight = None
                self.scheduler.update(planned.plan, running.result())
            self._runner_thread.shutdown()
            self._runner_thread = None
        tp = self.tensor_parallel
        stopped = tp is not None and not tp.failed
        if stopped:
            try:
                tp.send_stop()
            except CollectiveFailed:
                logger.warning("the tensor-parallel ranks could not be told to stop; killing them")
                stopped = False
        self._release(stopped)

    def _release(self, stopped: bool) -> None:
        """Wait for stopped workers to leave (kill them otherwise), then leave the process group; close the draft
        model's engine."""
        draft, self._draft_engine = getattr(self, "_draft_engine", None), None
        if draft is not None:
            draft.close()
        tp, workers = self.tensor_parallel, self._workers
        self.tensor_parallel = self._workers = None
        if workers is not None:
            workers.join() if stopped else workers.kill()
        if tp is not None:
            tp.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """The tensor-parallel worker processes this engine started (its node's ranks other than 0)."""
        return [] if self._workers is None else self._workers.pids

    def stats(self) -> EngineStats:
        kv = self.kv_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self._num_waiting,
            num_pages=kv.num_pages,
            num_free_pages=kv.num_free_pages,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            last_step_tokens=self._last_step_tokens,
            cpu_threads=self.runner.cpu_threads,
            **self.scheduler.lora_adapters(),
            **self.speculator.counters(),
            **self._encoder_counters(),
        )

    def _encoder_counters(self) -> dict[str, int | float]:
        cache = self.encoder_cache
        if cache is None:
            return {}
        return {
            "images_processed": self._images_received,
            "encoder_cache_hits": cache.hits,
            "encoder_cache_usage": cache.used / cache.capacity,
        }

    def queue_room(self) -> int | None:
        """Requests the waiting queue takes before it is full; None when it is unbounded."""
        if not self.config.scheduler.max_queue_size:
            return None
        return max(0, self.config.scheduler.max_queue_size - self._num_waiting)

    def is_idle_and_clean(self) -> bool:
        """True when nothing is in flight and every page is free or merely cached (tests and debug checks)."""
        return not self.has_unfinished() and not self._awaiting_grammar and self.kv_cache.all_free()


_IDLE_PLAN = SchedulerOutput()


@dataclass(frozen=True, slots=True)
class _Planned:
    """A plan, with the waiting queue it chose from (observers only) and the seconds planning took."""

    plan: SchedulerOutput
    queue: tuple[QueuedRequest, ...]
    seconds: float


KEEP_ALIVE_INTERVAL_S = 0.25
"""An idle engine's ranks hear from it this often at most: its loop passes every few milliseconds while a grammar
compiles, and each empty plan costs a broadcast on every rank."""


def _vocabulary_difference(
    target_dir: str, draft_dir: str, target: PretrainedConfig, draft: PretrainedConfig
) -> str | None:
    """Why the draft's token ids would not mean the served model's: vocabulary sizes, or tokenizers that map some
    text to other ids (compared where both directories have one); None when they agree."""
    if target.vocab_size != draft.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the served model's {target.vocab_size}"
    from engine.models.tokenizer import auto_tokenizer

    try:
        target_vocab = auto_tokenizer(target_dir).get_vocab()
        draft_vocab = auto_tokenizer(draft_dir).get_vocab()
    except (OSError, ValueError):
        return None  # a directory without a tokenizer: the ids are all there is to compare
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        return f"their tokenizers differ (for example {differing})"
    return None


def _raise_if_failed(grammar: Future[CompiledGrammar]) -> None:
    """Raise a compile failure as a fresh RequestRejected: a cached failure is raised for every request repeating it
    (the compiler fails only with RequestRejected)."""
    error = grammar.exception()
    if error is not None:
        raise RequestRejected(str(error), code=getattr(error, "code", "invalid_structured_output"))
