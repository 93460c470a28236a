"""Prometheus metrics: vLLM's names and meanings under a `ferry:` prefix, every one labelled with `model_name`.

Dashboards written for vLLM port by a prefix change. Beyond vLLM: `ferry:request_rejected_total{reason}` and
latency buckets fine enough for fast GPUs (inter-token latency from 1 ms). One metric keeps vLLM's own name and
labels: `vllm:lora_requests_info`, which routers (the Gateway API Inference Extension's endpoint picker) read as
it is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from engine.core.stats import EngineStats

RejectionReason = Literal["queue_full", "timeout", "invalid", "unauthorized", "unavailable"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0, 320.0, 640.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# What /metrics.json carries (and the built-in page's engine view reads): every gauge and counter of /metrics.
SNAPSHOT_SAMPLES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "images_processed_total",
    "encoder_cache_hits_total",
    "encoder_cache_usage_perc",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "request_rejected_total",
    "tensor_parallel_size",
    "model_weight_bytes",
    "cpu_threads",
)


BATCH_STATUSES = (
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
)  # fmt: skip


class ServerMetrics:
    """The server's own registry (not the process-global one), so apps never collide on metric names."""

    def __init__(self, model_name: str, tensor_parallel_size: int = 1, max_loras: int | None = None) -> None:
        """`max_loras`: --max-loras with --enable-lora (None: LoRA is off, and its metric absent)."""
        self.registry = CollectorRegistry()
        model = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, model, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*model, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, model, buckets=buckets, registry=self.registry)

        self._model_name = model_name
        self.num_requests_running = gauge(
            "ferry:num_requests_running", "Requests in the engine's running batch."
        ).labels(model_name)
        self.num_requests_waiting = gauge("ferry:num_requests_waiting", "Requests waiting for admission.").labels(
            model_name
        )
        tensor_parallel = gauge("ferry:tensor_parallel_size", "Ranks the model is sharded over (1: one device).")
        tensor_parallel.labels(model_name).set(tensor_parallel_size)
        self._model_weight_bytes = gauge(
            "ferry:model_weight_bytes", "Bytes of the model's weights as stored (quantized included), on each rank."
        ).labels(model_name)
        self._model_info = Gauge(
            "ferry:model_info",
            "1, labelled with how the model is stored: --quantization of its linear weights, the KV cache's dtype.",
            [*model, "quantization", "kv_cache_dtype"],
            registry=self.registry,
        )
        self.kv_cache_usage_perc = gauge(
            "ferry:kv_cache_usage_perc", "Fraction of KV-cache pages in use by requests (1 means 100 percent)."
        ).labels(model_name)
        self.cpu_threads = gauge(
            "ferry:cpu_threads",
            "Torch threads the engine's last CPU step ran on: by the step's size and, by default, the cores other "
            "processes leave free (--cpu-threads, --cpu-prefill-threads); 0 on a GPU.",
        ).labels(model_name)
        self.prompt_tokens = counter("ferry:prompt_tokens", "Prompt tokens of admitted requests.").labels(model_name)
        self.generation_tokens = counter(
            "ferry:generation_tokens", "Tokens generated and delivered to clients."
        ).labels(model_name)
        self._request_success = counter(
            "ferry:request_success", "Requests that finished, by finish reason (stop, length).", ("finished_reason",)
        )
        self.prefix_cache_queries = counter(
            "ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self.prefix_cache_hits = counter("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(
            model_name
        )
        self.num_preemptions = counter("ferry:num_preemptions", "Requests preempted to free KV-cache pages.").labels(
            model_name
        )
        self.images_processed = counter(
            "ferry:images_processed", "Images in the prompts the engine took (an image model's)."
        ).labels(model_name)
        self.encoder_cache_hits = counter(
            "ferry:encoder_cache_hits", "Images whose encoding the encoder cache held already."
        ).labels(model_name)
        self.encoder_cache_usage_perc = gauge(
            "ferry:encoder_cache_usage_perc", "Fraction of the encoder cache (--encoder-cache-tokens) in use."
        ).labels(model_name)
        self.spec_decode_num_drafts = counter(
            "ferry:spec_decode_num_drafts", "Draft runs verified (one request's drafts in one step)."
        ).labels(model_name)
        self.spec_decode_num_draft_tokens = counter(
            "ferry:spec_decode_num_draft_tokens", "Drafted tokens verified."
        ).labels(model_name)
        self.spec_decode_num_accepted_tokens = counter(
            "ferry:spec_decode_num_accepted_tokens", "Drafted tokens accepted."
        ).labels(model_name)
        self._spec_decode_accepted_per_pos = counter(
            "ferry:spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by their position in the draft run (0: the first).",
            ("position",),
        )
        self.time_to_first_token = histogram(
            "ferry:time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS
        ).labels(model_name)
        self.inter_token_latency = histogram(
            "ferry:inter_token_latency_seconds", "Time between consecutive generated tokens.", ITL_BUCKETS
        ).labels(model_name)
        self.e2e_request_latency = histogram(
            "ferry:e2e_request_latency_seconds", "Arrival to last token of a finished request.", E2E_BUCKETS
        ).labels(model_name)
        self.request_queue_time = histogram(
            "ferry:request_queue_time_seconds", "Time a request waited before first being scheduled.", QUEUE_BUCKETS
        ).labels(model_name)
        self.iteration_tokens = histogram(
            "ferry:iteration_tokens_total", "Tokens computed per engine step.", ITERATION_TOKEN_BUCKETS
        ).labels(model_name)
        self._batch_requests = counter(
            "ferry:batch_requests",
            "Requests of the Batch API recorded, by outcome: completed (output file) or failed (error file).",
            ("outcome",),
        )
        self._batches = Gauge(
            "ferry:batches", "Batches stored, by status (every replica's: read from the database).",
            [*model, "status"], registry=self.registry,
        )  # fmt: skip
        self._request_rejected = counter(
            "ferry:request_rejected",
            "Requests refused, by reason: queue_full, timeout, invalid, unauthorized, unavailable.",
            ("reason",),
        )
        self._max_loras = max_loras
        self._lora_info: Gauge | None = None
        if max_loras is not None:
            # As vLLM has it: one series per combination of adapters seen, valued at the time it was last seen, so
            # the newest series is the engine's current state (a router takes the series with the highest value).
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )
        self._last_stats: EngineStats | None = None

    def set_model_info(self, weight_bytes: int, quantization: str, kv_cache_dtype: str) -> None:
        """What the engine reports once the model is loaded."""
        self._model_weight_bytes.set(weight_bytes)
        self._model_info.labels(self._model_name, quantization, kv_cache_dtype).set(1)

    def observe_engine_stats(self, stats: EngineStats) -> None:
        """Gauges follow the engine's latest stats; its cumulative counters become increments."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.cpu_threads.set(stats.cpu_threads)
        last = self._last_stats
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self.num_preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self.images_processed.inc(stats.images_processed - (last.images_processed if last else 0))
        self.encoder_cache_hits.inc(stats.encoder_cache_hits - (last.encoder_cache_hits if last else 0))
        self.encoder_cache_usage_perc.set(stats.encoder_cache_usage)
        if stats.spec_decode_num_drafts > (last.spec_decode_num_drafts if last else 0):
            self._observe_drafts(stats, last)
        if stats.num_steps > (last.num_steps if last else 0):  # a step that ran the model (not idle, not abort-only)
            self.iteration_tokens.observe(stats.last_step_tokens)
        if self._lora_info is not None:
            self._lora_info.labels(
                max_lora=str(self._max_loras),
                waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
                running_lora_adapters=",".join(stats.running_lora_adapters),
            ).set_to_current_time()
        self._last_stats = stats

    def _observe_drafts(self, stats: EngineStats, last: EngineStats | None) -> None:
        self.spec_decode_num_drafts.inc(stats.spec_decode_num_drafts - (last.spec_decode_num_drafts if last else 0))
        self.spec_decode_num_draft_tokens.inc(
            stats.spec_decode_num_draft_tokens - (last.spec_decode_num_draft_tokens if last else 0)
        )
        self.spec_decode_num_accepted_tokens.inc(
            stats.spec_decode_num_accepted_tokens - (last.spec_decode_num_accepted_tokens if last else 0)
        )
        before = last.spec_decode_num_accepted_tokens_per_pos if last else ()
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            done = before[position] if position < len(before) else 0
            if count > done:
                self._spec_decode_accepted_per_pos.labels(self._model_name, str(position)).inc(count - done)

    def count_success(self, finish_reason: str) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()

    def count_batch_request(self, failed: bool) -> None:
        self._batch_requests.labels(self._model_name, "failed" if failed else "completed").inc()

    def set_batches(self, by_status: dict[str, int]) -> None:
        """The gauge of batches by status; every status OpenAI names is present, 0 when none."""
        for status in BATCH_STATUSES:
            self._batches.labels(self._model_name, status).set(by_status.get(status, 0))

    def count_rejection(self, reason: RejectionReason) -> None:
        self._request_rejected.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """/metrics' gauges and counters as one JSON-ready dict (sample names without the `ferry:` prefix, each
        summed over its other labels), plus the derived prefix-cache hit rate and the server's clock.

        Read back from the registry, not from separate bookkeeping, so that it always agrees with /metrics.
        """
        totals: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.labels.get("model_name") == self._model_name:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        snapshot: dict[str, Any] = {"model_name": self._model_name, "time": time.time()}
        for name in SNAPSHOT_SAMPLES:
            value = totals.get(f"ferry:{name}", 0.0)
            snapshot[name] = value if name.endswith("_usage_perc") else int(value)
        queries = snapshot["prefix_cache_queries_total"]
        snapshot["prefix_cache_hit_rate"] = snapshot["prefix_cache_hits_total"] / queries if queries else None
        drafted = snapshot["spec_decode_num_draft_tokens_total"]
        snapshot["spec_decode_acceptance_rate"] = (
            snapshot["spec_decode_num_accepted_tokens_total"] / drafted if drafted else None
        )
        return snapshot


def rejection_reason(status_code: int) -> RejectionReason | None:
    """The rejection an error status stands for; None for errors that are not a refusal (500)."""
    if status_code == 429:
        return "queue_full"
    if status_code == 504:
        return "timeout"
    if status_code == 401:
        return "unauthorized"
    if status_code == 503:
        return "unavailable"
    if 400 <= status_code < 500:
        return "invalid"
    return None


class RequestTimer:
    """Latency of one engine request as the front end sees it, fed into the histograms."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_token: float | None = None

    def on_output(self, received: float, num_tokens: int, queue_seconds: float | None) -> None:
        metrics = self._metrics
        if queue_seconds is not None:
            metrics.request_queue_time.observe(queue_seconds)
        if num_tokens == 0:
            return
        metrics.generation_tokens.inc(num_tokens)
        if self._last_token is None:
            metrics.time_to_first_token.observe(received - self._arrival)
        else:
            # Tokens that arrive together (one step, several tokens) share the gap evenly.
            gap = (received - self._last_token) / num_tokens
            for _ in range(num_tokens):
                metrics.inter_token_latency.observe(gap)
        self._last_token = received

    def on_finish(self, now: float, finish_reason: str) -> None:
        self._metrics.e2e_request_latency.observe(now - self._arrival)
        self._metrics.count_success(finish_reason)
