"""The engine's options: one frozen config per component, composed into `EngineConfig`.

Each component receives the part it reads (the scheduler a `SchedulerConfig`, the KV-cache manager a
`CacheConfig`, ...). Each field's docstring is also its `ferry serve --help` text, and its metadata the help section
it is listed under (server/flags.py turns every field of every part into a flag); `metadata["aliases"]` are other
names the flag accepts. `EngineConfig.of(**options)` builds one from flat keyword options, each routed to the part
that has a field of that name (what the CLI, the benchmarks and the tests write).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

SchedulerPolicy = Literal["fifo", "prefill_first"]
SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
CompileLevel = Literal["none", "piecewise", "full"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
Quantization = Literal["none", "int8", "int8-dynamic", "int4", "fp8"]
GroupSize = Literal[32, 64, 128]
Runner = Literal["auto", "generate", "pooling"]
PoolingTypeOption = Literal["auto", "last", "mean", "cls"]

_MODEL = {"group": "model"}
_KV_CACHE = {"group": "KV cache"}
_SCHEDULING = {"group": "scheduling"}
_PARALLEL = {"group": "tensor parallelism"}
_LORA = {"group": "LoRA adapters"}


class EngineStartupError(ValueError):
    """The options cannot run on this model and machine (found while the engine starts): the message names the
    flags to change, or the model's feature that is refused (the subclasses: engine/models/support.py,
    engine/pooling/config.py, engine/attention/base.py, engine/quantization)."""


@dataclass(frozen=True)
class ModelConfig:
    """What model runs, in what dtype, on which device and with which kernels (the loader's and the runner's part)."""

    path: str = field(metadata={"flag": False})
    """A local Hugging Face model directory (config.json, safetensors, tokenizer files). No flag of its own:
    `ferry serve` resolves it from --model, or serves the model embedded in the package."""
    dtype: DType = field(default="auto", metadata=_MODEL)
    """Weights and activations dtype; `auto` is bfloat16 on GPU, and on CPU the checkpoint's bfloat16, else
    float32."""
    device: str = field(default="auto", metadata=_MODEL)
    """Device the engine runs on: `auto` (cuda when available), `cpu` or `cuda[:N]`."""
    load_format: Literal["auto", "dummy"] = field(default="auto", metadata=_MODEL)
    """`auto` reads the weights in the model directory; `dummy` builds random weights from config.json
    alone, for benchmarking big models without weights."""
    max_model_len: int | None = field(default=None, metadata=_MODEL)
    """Longest prompt + output in tokens; by default the model's `max_position_embeddings`, lowered (with a
    warning) to what the KV cache holds. A value set here that the cache cannot hold stops the start-up."""
    attention_backend: Literal["auto", "torch", "cpu", "flash", "triton"] = field(default="auto", metadata=_MODEL)
    """Attention kernels: `torch` (any device; gathers each sequence's pages every step), `cpu` (a C++ kernel
    compiled at first use and cached, reads the pages in place), `flash` (flash-attn on CUDA, reads the pages in
    place; page sizes that are multiples of 256) or `triton` (a Triton kernel on CUDA, reads the pages in place at
    any page size); `auto` takes cpu on CPU when it builds (a C++ compiler is needed), and on CUDA flash when
    flash-attn is installed and the page size suits it, else triton when it is installed, torch otherwise."""
    model_impl: Literal["auto", "native", "transformers"] = field(default="auto", metadata=_MODEL)
    """`auto` uses the native Llama-family modules where they run the model exactly and the transformers adapter
    otherwise; a model neither runs exactly is refused at load (see "Models" in the README)."""
    quantization: Quantization = field(default="none", metadata={**_MODEL, "aliases": ("-q",)})
    """Quantize the decoder's linear weights as they load and compute from them quantized (engine/quantization/):
    `int8` (weight-only, a scale per output channel), `int8-dynamic` (int8 weights and int8 activations with a
    scale per token, integer dot products), `int4` (weight-only, groups of --quantization-group-size inputs with a
    scale and a minimum each), `fp8` (e4m3 weights with a scale per output channel, scaled matmuls on GPU; on CPU
    the same arithmetic, slowly, for tests). Under int8, int8-dynamic and int4 the LM head is int8 (a tied
    embedding reads its rows from it); an untied embedding, and fp8's head, keep the model's dtype. int8 and int4
    run on CPU only; every scheme on the native Llama-family modules only."""
    quantization_group_size: GroupSize = field(default=128, metadata=_MODEL)
    """Inputs per int4 group (32, 64 or 128): smaller groups follow the weights more closely and cost more bytes
    of scales."""
    runner: Runner = field(default="auto", metadata=_MODEL)
    """What the model serves: `generate` (chat, completions, responses) or `pooling` (embeddings, rerank, score);
    `auto` pools for a sentence-transformers model (modules.json with a Pooling module), a BERT-family encoder or
    a sequence classifier (a cross-encoder), and generates otherwise. A model that can do neither is refused."""
    pooling_type: PoolingTypeOption = field(default="auto", metadata=_MODEL)
    """How a pooling model makes one vector of an input's hidden states: the `last` token's, the `mean` over its
    tokens, or the first token's (`cls`); `auto` reads sentence-transformers' Pooling module, else takes last for
    a decoder and cls for an encoder."""
    pooling_normalize: Literal["auto", "true", "false"] = field(default="auto", metadata=_MODEL)
    """Scale embeddings to unit length: `auto` where the sentence-transformers modules end with Normalize (without
    modules.json: true)."""
    reranker_tokens: str | None = field(default=None, metadata=_MODEL)
    """Also serve a causal LM as a yes/no reranker (Qwen3-Reranker style): `yes,no` names the two tokens whose
    logits at the end of a query-document prompt (--reranker-template) score it, P(yes) over the two;
    /v1/rerank and /v1/score then use it, and the model still generates."""
    reranker_template: str = field(default="<Query>: {query}\n<Document>: {document}\n<Relevant>:", metadata=_MODEL)
    """The prompt a yes/no reranker scores (--reranker-tokens): `{query}` and `{document}` are replaced by a
    request's texts (the chat template is not applied: write the model's own format here)."""

    limit_mm_per_prompt: str | None = field(default=None, metadata=_MODEL)
    """Most images one prompt may hold, as vLLM writes it: `image=4` or `{"image": 4}` (default 4 on an image
    model). `image=0` serves an image model's language model alone: a request with an image is refused."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization_group_size not in get_args(GroupSize):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size}")
        _ = self.max_images  # a malformed limit stops here, not at the first request

    @property
    def max_images(self) -> int:
        """Images one prompt may hold (--limit-mm-per-prompt; 4 by default)."""
        text = (self.limit_mm_per_prompt or "").strip()
        if not text:
            return DEFAULT_MAX_IMAGES
        try:
            limits = json.loads(text) if text.startswith("{") else dict(_limit(part) for part in text.split(","))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"limit_mm_per_prompt must be like 'image=4' or '{{\"image\": 4}}', got {text!r}") from exc
        if not isinstance(limits, dict) or set(limits) - {"image"}:
            raise ValueError(f"limit_mm_per_prompt limits images only ('image'), got {text!r}")
        count = limits.get("image", DEFAULT_MAX_IMAGES)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt's image count must be an integer >= 0, got {count!r}")
        return count


DEFAULT_MAX_IMAGES = 4


def _limit(part: str) -> tuple[str, int]:
    name, _, count = part.partition("=")
    return name.strip(), int(count)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page size, how many pages, prefix sharing (the KV-cache manager's part)."""

    page_size: int = field(default=16, metadata=_KV_CACHE)
    """Tokens per KV-cache page."""
    num_pages: int | None = field(default=None, metadata={**_KV_CACHE, "aliases": ("--num-blocks",)})
    """Number of KV-cache pages (also accepted as --num-blocks, transformers' and vLLM's name); by default derived
    from the memory budget: max_memory_percent on GPU, cpu_kv_cache_gib on CPU."""
    max_memory_percent: float = field(default=0.9, metadata=_KV_CACHE)
    """GPU: fraction of the device memory free once the model is loaded that the KV cache and the largest step's
    activations may take together (the activations are measured by a profiling step at start-up); with tensor
    parallelism each rank's own GPU, and every rank takes the pages the fullest one can hold."""
    cpu_kv_cache_gib: float = field(default=1.0, metadata=_KV_CACHE)
    """CPU: GiB given to the KV cache (by each rank, with tensor parallelism: a rank's cache holds its KV heads)."""
    enable_prefix_caching: bool = field(default=True, metadata=_KV_CACHE)
    """Share KV-cache pages between requests with a common prompt prefix (full pages, matched by a hash chain
    over their tokens); freed pages stay cached until evicted, least recently used first."""
    kv_cache_dtype: KVCacheDType = field(default="auto", metadata=_KV_CACHE)
    """What the KV cache stores K and V in (vLLM's names): `auto` the model's dtype; `fp8` (or `fp8_e4m3`) float8
    e4m3, one byte an element, so the same memory holds twice a bfloat16 model's pages (four times float32's) and
    max_model_len and admission count those pages. K and V are divided by their layer's scale and saturated to
    +-448 as they are written, multiplied back as they are read. The scales are 1.0, as vLLM's without calibrated
    ones (checkpoint scales are not read): a scale only shifts e4m3's span, since its 3 mantissa bits give every
    value from 2^-6 to 448 the same relative precision (1/16), and K and V of the usual magnitudes lie in it.
    Attention computes in the model's dtype. The torch, cpu and triton backends read it (triton on GPUs of compute
    capability 8.9 and up); flash cannot, and `auto` passes over it."""
    encoder_cache_tokens: int = field(default=8192, metadata=_KV_CACHE)
    """An image model's encoder cache: image embeddings held, in tokens (one per image token), so an image is
    encoded once however many requests or prefill chunks read it; the least recently used are dropped first,
    never one a running prefill still needs. It must hold the largest image a prompt may carry."""
    debug_checks: bool = field(default=False, metadata=_SCHEDULING)
    """Assert KV-cache page-accounting invariants inside the page pools after every change (slow; tests turn
    this on)."""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.encoder_cache_tokens < 1:
            raise ValueError(f"encoder_cache_tokens must be >= 1, got {self.encoder_cache_tokens}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0.0 < self.max_memory_percent <= 1.0:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent}")
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(get_args(KVCacheDType))}, got {self.kv_cache_dtype!r}"
            )


SpeculativeMethod = Literal["ngram", "suffix", "draft_model"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative/): where drafts come from and how many a request may carry. The
    keys are vLLM's `--speculative-config` keys; `from_json` reads that flag's JSON."""

    method: SpeculativeMethod
    """`ngram`: prompt lookup, the tokens that followed the latest earlier occurrence of the sequence's last
    n-gram; `suffix`: suffix trees over each request and over recent requests' outputs, scored by frequency;
    `draft_model`: a smaller model on the same tokenizer (`model`), run greedily by an engine of its own."""
    model: str | None = None
    """draft_model: the draft model's directory (same tokenizer and vocabulary as the served model)."""
    num_speculative_tokens: int = 4
    """Most drafts a request carries into one step (fewer where its drafts are seldom accepted)."""
    prompt_lookup_min: int = 2
    """ngram: the shortest n-gram that proposes."""
    prompt_lookup_max: int = 5
    """ngram: the longest n-gram tried (the longest match proposes)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest suffix matched, and the deepest a tree goes."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: finished requests whose outputs are kept to draft from (oldest dropped first)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: drafts at most this many times the matched suffix's length."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: drafting stops where the path's estimated probability falls below this."""
    adaptive: bool = True
    """How many drafts a request carries is decided each step from the measured step costs and its acceptance
    (engine/speculative/gate.py); false: always as many as the source has, up to num_speculative_tokens."""
    disable_by_batch_size: int | None = None
    """No drafts while more requests than this run; by default the engine decides each step from the step times
    it measures (engine/speculative/gate.py)."""

    def __post_init__(self) -> None:
        if self.method not in get_args(SpeculativeMethod):
            raise ValueError(
                f"speculative method must be one of {', '.join(get_args(SpeculativeMethod))}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 1 and max_cached_requests >= 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative `model` (a draft model's directory) goes with method draft_model, and only")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of `--speculative-config`'s JSON object; unknown keys are an error, never ignored."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--speculative-config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in values:
            raise ValueError(f"--speculative-config needs a method: one of {', '.join(get_args(SpeculativeMethod))}")
        return cls(**values)


@dataclass(frozen=True)
class SchedulerConfig:
    """How steps are planned: budgets, policies, the waiting queue, request seeds (the scheduler's part)."""

    max_batch_tokens: int = field(default=2048, metadata=_SCHEDULING)
    """Token budget of one engine step: decode tokens plus prefill chunks."""
    max_num_seqs: int = field(default=256, metadata=_SCHEDULING)
    """Most sequences in one engine step."""
    scheduler_policy: SchedulerPolicy = field(default="fifo", metadata=_SCHEDULING)
    """Who gets each step's token budget first. `fifo`: running requests, then waiting ones in arrival order;
    `prefill_first`: waiting requests, then running ones."""
    scheduling_policy: SchedulingPolicy = field(default="fcfs", metadata=_SCHEDULING)
    """Order of the waiting queue and choice of preemption victims (vLLM's option). `fcfs`: arrival order, the
    newest running request is preempted first; `priority`: by each request's `priority` (lower runs first, ties in
    arrival order), running requests get the step's budget in that order, and the lowest-priority running request
    is preempted first. Under either, the Batch API's requests wait behind every interactive one and are preempted
    first."""
    safety_margin: float = field(default=0.0, metadata=_SCHEDULING)
    """Fraction of all pages kept free for running sequences to grow into: no new prefill is admitted below it."""
    max_queue_size: int = field(default=1024, metadata=_SCHEDULING)
    """Most requests waiting for admission; beyond it the server answers 429 with Retry-After. 0 means
    unbounded."""
    seed: int = field(default=0, metadata=_SCHEDULING)
    """Seed for requests that sample without a seed of their own."""
    async_scheduling: bool = field(default=False, metadata=_SCHEDULING)
    """Plan each step while the one before it runs (the model on a thread of its own), vLLM's option: the host
    work of scheduling overlaps the forward pass. Greedy output is the same; a request that stops on EOS or a
    stop token computes one more token, discarded."""
    speculative_config: SpeculativeConfig | None = field(default=None, metadata=_SCHEDULING)
    """Speculative decoding, as a JSON object with vLLM's keys: `{"method": "ngram", "num_speculative_tokens": 4}`
    (prompt lookup; `prompt_lookup_min`, `prompt_lookup_max`) or `{"method": "suffix"}`. Drafts are verified in
    the step's one forward pass: greedy and seeded output are the same as without them. Off by default."""

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(f"safety_margin must be in [0, 1), got {self.safety_margin}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.scheduler_policy not in get_args(SchedulerPolicy):
            raise ValueError(f"scheduler_policy must be 'fifo' or 'prefill_first', got {self.scheduler_policy!r}")


@dataclass(frozen=True)
class ExecutionConfig:
    """How a planned step runs: compilation, CUDA graphs, CPU threads (the runner's part)."""

    compile: CompileLevel = field(default="none", metadata=_MODEL)
    """torch.compile of the native model (engine/execution/compile.py): `none` runs eagerly; `piecewise` compiles each
    decoder layer into one graph all layers share, paged attention an opaque op inside it; `full` compiles the
    whole decoder into one graph. Compiled at start-up (seconds; torch caches inductor's output for the next
    start), with a dynamic token dimension so ragged steps do not recompile. CPU and the native Llama-family
    modules only: other setups refuse a level other than none at start-up."""
    enforce_eager: bool = field(default=False, metadata=_MODEL)
    """Run every step eagerly, op by op (vLLM's option). By default, on CUDA, decode steps replay CUDA graphs
    captured at start-up (engine/execution/cuda_graphs.py) where the attention backend allows it (steps with a
    prefill chunk, tensor parallelism and the transformers adapter always run eagerly); on CPU the native Llama
    family's decoder runs as one C++ call where it can (engine/models/llama_fused.py)."""
    cuda_graph_max_seqs: int = field(default=256, metadata=_MODEL)
    """CUDA: the largest decode step (in sequences) replayed from a graph, capped by max_num_seqs and
    max_batch_tokens; graphs are captured for 1, 2, 4, 8, then every 8 up to 64, then every 16 up to it, and a
    step is padded to the next size. Larger steps run eagerly."""
    cpu_threads: int | None = field(default=0, metadata=_SCHEDULING)
    """CPU: torch threads in the engine process for a decode-sized step. 0 follows the load: every core of this
    rank (shared among the tensor-parallel ranks of a node) that other processes leave free, measured over the last
    quarter second (engine/execution/cpu_threads.py). With two OpenMP threads every op ends in a barrier that stalls
    whenever another process holds a core, so a busy machine gets fewer threads (measured on 2 cores: 802 tok/s on
    one thread, 323 on two beside a busy process); an idle one gets every core (offline on 2 cores, 64 requests of
    the tiny Llama: 1.20x vLLM-CPU with both, 0.64x with one). Under `ferry serve` the front end and its clients
    are the others. None (from Python) leaves torch's setting alone."""
    cpu_prefill_threads: int | None = field(default=None, metadata=_SCHEDULING)
    """CPU: torch threads for a step of at least 256 tokens (one with prefill chunks), or of at most 4 sequences with
    64 or more; cpu_threads for the others. Such a step is long and compute-bound, and the front end waits for its
    tokens, so a second core pays off even beside a busy front end (measured on 2 cores serving the demo model at
    concurrency 32: TTFT p99 665 -> 409 ms). None: every core of this rank but those that processes other than the
    engine's parent (the front end) keep busy (beside a spinning process a 280M model's prompt came sooner on one
    thread: TTFT 491 against 866 ms); a fixed count at most a fixed cpu_threads turns it off, and so does
    cpu_threads None."""

    def __post_init__(self) -> None:
        if self.compile not in get_args(CompileLevel):
            raise ValueError(f"compile must be one of {', '.join(get_args(CompileLevel))}, got {self.compile!r}")
        if self.cuda_graph_max_seqs < 1:
            raise ValueError(f"cuda_graph_max_seqs must be >= 1, got {self.cuda_graph_max_seqs}")
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: follow the load), got {self.cpu_threads}")
        if self.cpu_prefill_threads is not None and self.cpu_prefill_threads < 1:
            raise ValueError(f"cpu_prefill_threads must be >= 1, got {self.cpu_prefill_threads}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the ranks, the nodes they span and where they meet."""

    tensor_parallel_size: int = field(default=1, metadata=_PARALLEL)
    """Ranks the model is sharded over, one process (and on CUDA one GPU) each: attention heads, the MLP and the
    vocabulary are split Megatron-style, each rank's KV cache holds its own KV heads, and the scheduler and the
    sampler run once, in the engine process (rank 0). Native Llama-family models only; their attention heads, KV
    heads (or the ranks, when there are fewer KV heads) and MLP width must divide by it."""
    nnodes: int = field(default=1, metadata=_PARALLEL)
    """Machines the tensor-parallel ranks span (torchrun's option), tensor_parallel_size / nnodes ranks on each.
    Only node 0 serves HTTP; every other node runs its ranks and exits when node 0 stops."""
    node_rank: int = field(default=0, metadata=_PARALLEL)
    """This machine's index among the nnodes (torchrun's option): 0 serves HTTP and runs ranks 0..; node k runs
    the ranks k * tensor_parallel_size / nnodes onwards."""
    master_addr: str = field(default="127.0.0.1", metadata=_PARALLEL)
    """Address of node 0, where the ranks meet (torchrun's option); every node gives the same one."""
    master_port: int | None = field(default=None, metadata=_PARALLEL)
    """Port on master_addr where the ranks meet (torchrun's option); by default a free port on one node, and 29500
    (torchrun's default) across nodes."""
    distributed_timeout: float = field(default=60.0, metadata=_PARALLEL)
    """Seconds a rank waits in one collective (an all-reduce, the step's plan) before it declares a peer dead or
    hung: the engine then fails, /health turns 503 and the server exits non-zero. An idle engine sends its ranks an
    empty plan every second, so only a stuck peer reaches this."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.node_rank < 0:
            raise ValueError(f"node_rank must be >= 0, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")

    def check_layout(self) -> None:
        """Raise ValueError unless the nodes split the ranks evenly and node_rank names one of them (checked where
        ranks start: a layout is only wrong for the node that runs it)."""
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"nnodes ({self.nnodes}) must divide tensor_parallel_size ({self.tensor_parallel_size}): every node "
                "runs as many ranks"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (engine/lora/): how many, how large."""

    enable_lora: bool = field(default=False, metadata=_LORA)
    """Serve LoRA adapters on the base model: a request names one as its `model` (--lora-modules, or loaded while
    serving). Requests for different adapters and for the base run in the same steps."""
    max_loras: int = field(default=4, metadata=_LORA)
    """Adapters in use by the running requests at once (one weight slot each); a request for another adapter
    waits until a slot frees."""
    max_lora_rank: int = field(default=16, metadata=_LORA)
    """Largest adapter rank accepted: each slot holds this rank, and a smaller adapter is padded with zeros."""
    max_cpu_loras: int | None = field(default=None, metadata=_LORA)
    """Adapters kept loaded in memory, the least recently used evicted (and read from disk again when next
    used); at least max_loras, which is the default."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded: max_cpu_loras, or max_loras by default."""
        return self.max_cpu_loras or self.max_loras


_ALIASES = {"num_blocks": "num_pages", "model": "path"}
"""Flat option names that differ from their field's: `model` is the model directory, `num_blocks` the old name of
num_pages."""


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, by the component that reads it."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """The config of flat options (`EngineConfig.of(model=path, page_size=32, tensor_parallel_size=2)`), each
        routed to the part with a field of its name; an unknown name is a TypeError, as for a dataclass."""
        parts = _by_part(options)
        return cls(**{part: part_cls(**parts.get(part, {})) for part, part_cls in PART_CLASSES.items()})

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with flat options changed (`config.replace(max_model_len=512)`), routed as in `of`."""
        parts = _by_part(options)
        return dataclasses.replace(
            self, **{part: dataclasses.replace(getattr(self, part), **values) for part, values in parts.items()}
        )


def _by_part(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat options grouped by the part that has a field of each name."""
    parts: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        name = _ALIASES.get(name, name)
        if name not in _PART_OF_FIELD:
            raise TypeError(f"EngineConfig has no option {name!r}")
        parts.setdefault(_PART_OF_FIELD[name], {})[name] = value
    return parts


PART_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "execution": ExecutionConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}
"""EngineConfig's parts by attribute name, in flag order."""

_PART_OF_FIELD = {f.name: part for part, part_cls in PART_CLASSES.items() for f in dataclasses.fields(part_cls)}
