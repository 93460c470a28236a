"""Start-up in one place: what turns a loaded model into a runner that serves, the same on every rank.

`start_runner` makes sure the attention backend reads the KV cache's dtype (`--kv-cache-dtype`), sizes the KV cache
(on CUDA after profiling the largest step and the decode graphs' memory, engine/execution/memory.py; with tensor
parallelism the smallest count over the ranks), fits `max_model_len` to what the cache holds, allocates the runner
and its cache, compiles every graph a step can need (`--compile`, engine/execution/compile.py) and captures the
decode graphs (engine/execution/cuda_graphs.py). The engine (engine/core/engine_core.py) and each tensor-parallel
worker (engine/distributed/worker.py) call it alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from engine.attention import UnsupportedAttention, select_backend
from engine.config import EngineConfig, EngineStartupError
from engine.core.kv_cache import GroupLayout, pool_pages
from engine.core.request import SamplingParams
from engine.core.step import NewRequest, SchedulerOutput
from engine.core.structured import GrammarCompiler
from engine.distributed.parallel import TensorParallel
from engine.execution.cpu_threads import SHORT_PREFILL_TOKENS
from engine.execution.cuda_graphs import CaptureReport, start_decode_graphs
from engine.execution.kv_caches import kv_cache_dtype, kv_cache_groups, layer_specs, state_bytes_per_sequence
from engine.execution.memory import kv_cache_budget_bytes
from engine.execution.runner import ModelRunner
from engine.models.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartedRunner:
    runner: ModelRunner
    loaded: LoadedModel
    """The model, its `max_model_len` fitted to the KV cache."""
    layouts: list[GroupLayout]
    pages: list[int]
    """Pages of each KV-cache group's pool."""
    cuda_graphs: CaptureReport | None
    """What was captured (sizes, seconds, memory); None when every step runs eagerly."""
    state_slots: int
    """Recurrent-state slots (engine/core/state_slots.py); 0 for a model without recurrent layers."""


def start_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    tp: TensorParallel | None = None,
    grammars: GrammarCompiler | None = None,
    runner_class: type[ModelRunner] = ModelRunner,
) -> StartedRunner:
    """The runner of `loaded` with its KV cache sized, its graphs compiled and captured, ready for the first step
    (`grammars`: the structured-output compiler to share, as ModelRunner takes it; `runner_class`: ModelRunner or
    a subclass of it, built as ModelRunner is)."""
    loaded, layouts, pages, state_slots = kv_cache_layout(config, loaded, tp)
    runner = runner_class(loaded, layouts, pages, config, grammars, state_slots=state_slots)
    if config.execution.compile != "none":
        warm_up(runner, config)
    return StartedRunner(runner, loaded, layouts, pages, start_decode_graphs(runner, config, loaded), state_slots)


def kv_cache_layout(
    config: EngineConfig, loaded: LoadedModel, tp: TensorParallel | None = None
) -> tuple[LoadedModel, list[GroupLayout], list[int], int]:
    """The KV-cache groups, the pages of each group's pool, `loaded` with the longest request those pages
    hold (`_fit_max_model_len`), and the recurrent-state slots (`state_slot_count`; 0 without recurrent layers).
    With tensor parallelism every rank sizes its own cache (its KV heads, its device's free memory) and all take
    the smallest count, since one scheduler hands out the same pages on every rank; every rank then fits the same
    max_model_len. `loaded` comes back with a backend that reads the cache's dtype (`_cache_backend`), which the
    profiling step on CUDA runs too."""
    cache_dtype = kv_cache_dtype(config.cache)
    loaded = _cache_backend(config, loaded, cache_dtype)
    layouts = kv_cache_groups(loaded.model, config.cache.page_size, cache_dtype)
    budget = 0.0
    if not config.cache.num_pages:
        if tp is not None and loaded.device.type == "cuda":
            # The profiling step's collectives wait only distributed_timeout: start it once every rank has loaded.
            tp.wait_for_peers()
        budget = kv_cache_budget_bytes(config, loaded, layouts)
    per_sequence = state_bytes_per_sequence(layer_specs(loaded.model, cache_dtype))
    slots = state_slot_count(config, per_sequence, budget, has_pages=layouts[0].page_bytes > 0)
    budget -= slots * per_sequence
    if layouts[0].page_bytes == 0:
        # No attention layer: pages hold no bytes, only the token count the scheduler plans with.
        pages = [
            config.cache.num_pages or config.scheduler.max_num_seqs * -(-loaded.max_model_len // config.cache.page_size)
        ]
    else:
        pages = pool_pages(
            layouts,
            num_pages=config.cache.num_pages,
            budget_bytes=budget,
            page_size=config.cache.page_size,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_batch_tokens=config.scheduler.max_batch_tokens,
        )
    if tp is not None:
        pages = tp.min_over_ranks(pages)
    max_model_len = _fit_max_model_len(config, loaded, cache_tokens=pages[0] * config.cache.page_size)
    return dataclasses.replace(loaded, max_model_len=max_model_len), layouts, pages, slots


def state_slot_count(config: EngineConfig, bytes_per_sequence: int, budget: float, has_pages: bool) -> int:
    """Recurrent-state slots: one per sequence that may run (`max_num_seqs`), fewer where the memory budget holds
    fewer states, which then bound admission (a model with attention layers gives its states at most half the
    budget, the pages the rest; with `--num-pages` the pages are sized apart and every sequence gets a slot).
    0 for a model without recurrent layers."""
    if not bytes_per_sequence:
        return 0
    wanted = config.scheduler.max_num_seqs
    if config.cache.num_pages:
        return wanted
    share = budget / 2 if has_pages else budget
    slots = min(wanted, int(share // bytes_per_sequence))
    if slots < 1:
        raise EngineStartupError(
            f"one sequence's recurrent state takes {bytes_per_sequence / 2**20:.1f} MiB, more than the cache's "
            f"{share / 2**20:.1f} MiB for states: give the cache more room with --cpu-kv-cache-gib (on a GPU, "
            "--max-memory-percent)"
        )
    if slots < wanted:
        logger.warning(
            "recurrent states for %d sequences at once fit the cache (%.1f MiB each), fewer than --max-num-seqs %d: "
            "admission waits for a free one beyond them",
            slots,
            bytes_per_sequence / 2**20,
            wanted,
        )
    return slots


def _cache_backend(config: EngineConfig, loaded: LoadedModel, cache_dtype: torch.dtype | None) -> LoadedModel:
    """`loaded` with an attention backend that writes and reads a KV cache of `cache_dtype` (None: the model's).

    The loader chose the backend for what the model's layers need; a cache of another dtype is the cache's choice,
    not the model's, so it is added here: an explicit `--attention-backend` that cannot read it is refused naming
    both flags (`UnsupportedAttention`), and `auto` is chosen again with it (on CUDA flash-attn gives way to the
    Triton kernel, or to the torch backend where that cannot read float8 either).
    """
    if cache_dtype is None:
        return loaded
    needs = dataclasses.replace(loaded.model.attention_needs(), kv_cache_dtype=cache_dtype)
    missing = loaded.backend.missing(needs, loaded.dtype)
    if not missing:
        return loaded
    name = config.model.attention_backend
    if name != "auto":
        raise UnsupportedAttention(
            f"--attention-backend {name} cannot compute {'; '.join(missing)}, which --kv-cache-dtype "
            f"{config.cache.kv_cache_dtype} asks for: choose another --attention-backend (auto takes one that can), "
            "or --kv-cache-dtype auto"
        )
    backend = select_backend(name, loaded.device.type, config.cache.page_size, loaded.dtype, needs)
    return dataclasses.replace(loaded, backend=backend)


_WARM_UP_TOKENS = (1, 2, 16, SHORT_PREFILL_TOKENS)
"""Step sizes the warm-up runs, in this order: the one-token graph (dynamo specializes sizes 0 and 1), then a second
size, which makes the token dimension dynamic (for 2 tokens and more), then a larger step, which must reuse it. A
bfloat16 `WidenedLinearMethod` (the fallback without the blocked kernel) branches on 3 rows, so there 16 gets a
third graph. The last, a lone prompt's size, runs on the prefill threads (engine/execution/cpu_threads.py), and a
graph is compiled for a thread count: the dynamic graph again, for them. Threads that follow the load run the
sizes once for each count they may take."""


def warm_up(runner: ModelRunner, config: EngineConfig) -> None:
    """Compile every graph now, so that no request waits for one: steps of a throwaway sequence of each warm-up size.

    Its K/V land in the first pages of every pool; nothing else is cached yet, and a page's slots are always written
    by the sequence that owns it before they are read.
    """
    capacity = min(runner.pool_pages) * config.cache.page_size
    sizes = sorted({min(n, config.scheduler.max_batch_tokens, capacity) for n in _WARM_UP_TOKENS})
    request_id = "compile-warm-up"
    pages = tuple(range(-(-sizes[-1] // config.cache.page_size)))
    prompt = (0,) * sizes[-1]
    new = NewRequest(
        request_id, prompt, (), SamplingParams(), frozenset(), 0, (pages,) * (max(runner.group_of_layer) + 1)
    )
    # Threads that follow the load take a few counts (engine/execution/cpu_threads.py): each its graphs.
    free = runner.step_threads.free if runner.step_threads is not None else None
    counts = free.counts() if free is not None else (None,)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    try:
        for i, (count, n) in enumerate(itertools.product(counts, sizes)):
            if free is not None:
                free.pinned = count
            # Each step (re)computes the sequence's first n positions: the runner takes plans as they come.
            runner.execute(
                SchedulerOutput(
                    request_ids=(request_id,),
                    num_computed_tokens=(0,),
                    num_new_tokens=(n,),
                    token_ids=(prompt[:n],),
                    samples=(True,),
                    new_requests=(new,) if i == 0 else (),
                )
            )
    except Exception as error:  # dynamo and inductor raise many types; each is a reason this level cannot run here
        raise EngineStartupError(
            f"--compile {config.execution.compile} failed at start-up ({type(error).__name__}: {_first_line(error)}); "
            "--compile none runs the model eagerly"
        ) from error
    finally:
        if free is not None:
            free.pinned = None
        runner.execute(SchedulerOutput(finished_ids=(request_id,)))
    logger.info(
        "compiled (--compile %s): %d graphs in %.1f s",
        config.execution.compile,
        torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        time.perf_counter() - started,
    )


def _fit_max_model_len(config: EngineConfig, loaded: LoadedModel, cache_tokens: int) -> int:
    """The longest request the engine takes: the model's limit, unless the whole KV cache holds fewer tokens.

    A cache that cannot hold one request of an explicitly asked `max_model_len` is refused (every request that
    leaves its length to the server would otherwise be refused); a default one is lowered to what fits.
    """
    wanted = loaded.max_model_len
    if wanted <= cache_tokens:
        return wanted
    budget_flag = "--max-memory-percent" if loaded.device.type == "cuda" else "--cpu-kv-cache-gib"
    if config.model.max_model_len is not None:
        raise EngineStartupError(
            f"the KV cache holds {cache_tokens} tokens ({cache_tokens // config.cache.page_size} pages of "
            f"{config.cache.page_size}), fewer than one request of --max-model-len {wanted} needs: lower "
            f"--max-model-len to at most {cache_tokens}, or give the cache more room with --num-pages or {budget_flag}"
        )
    logger.warning(
        "the KV cache holds %d tokens, fewer than the model's %d: max_model_len lowered to %d (choose it with "
        "--max-model-len, or give the cache more room with --num-pages or %s)",
        cache_tokens,
        wanted,
        cache_tokens,
        budget_flag,
    )
    return cache_tokens


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
