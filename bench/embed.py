"""`ferry bench embed`: embeddings per second through Ferry's server, sentence-transformers' `encode` in-process and
vLLM's pooling runner, over the same seeded inputs of mixed length.

The models are named shapes (BERT-base, Qwen3-Embedding-0.6B) with random weights, saved by sentence-transformers
itself into a cache folder, so every system loads the same directory. Their tokenizers map the word `x<id>` to token
`id` (a WordPiece or word-level vocabulary of the model's size), so a text of such words tokenizes to exactly the
ids drawn: sentence-transformers gets the texts (its `encode` takes text only and tokenizes them itself, as its users
pay for), the servers get those same ids, special tokens included, in batches on /v1/embeddings. Before any figure,
each system's vectors for a few inputs are compared with sentence-transformers' in float32 (cosine).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from bench.embed_config import DTYPES, EMBED_SHAPES, QWEN3_EOS, QWEN3_EOS_ID, SYSTEMS, EmbedOptions, EmbedShape
from bench.report import fmt, format_table, stamp
from bench.serve import free_port, started_server
from engine.execution.cpu_threads import CLOCK_TICKS, machine_busy_seconds

_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BERT_CLS, _BERT_SEP = _BERT_SPECIALS.index("[CLS]"), _BERT_SPECIALS.index("[SEP]")


def _word(token_id: int) -> str:
    return f"x{token_id}"


def _regular_ids(shape: EmbedShape) -> range:
    """The ids a drawn input's words take: every token but the specials."""
    vocab_size = int(shape.config["vocab_size"])
    return range(len(_BERT_SPECIALS), vocab_size) if shape.kind == "bert" else range(QWEN3_EOS_ID)


def embedder_tokenizer(shape: EmbedShape, max_length: int) -> PreTrainedTokenizerFast:
    """A tokenizer of the model's vocabulary size in which the word `x<id>` is token `id`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    vocab_size = int(shape.config["vocab_size"])
    if shape.kind == "bert":
        vocab = {piece: i for i, piece in enumerate(_BERT_SPECIALS)}
        vocab.update({_word(i): i for i in _regular_ids(shape)})
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", _BERT_CLS), ("[SEP]", _BERT_SEP)],
        )
        return BertTokenizerFast(
            tokenizer_object=tokenizer,
            unk_token="[UNK]",
            sep_token="[SEP]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            mask_token="[MASK]",
            model_max_length=max_length,
        )
    specials = [QWEN3_EOS, "<|im_start|>", "<|im_end|>"]
    specials += [f"<|extra_{i}|>" for i in range(vocab_size - QWEN3_EOS_ID - len(specials))]
    vocab = {_word(i): i for i in _regular_ids(shape)}
    vocab.update({piece: QWEN3_EOS_ID + i for i, piece in enumerate(specials)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=QWEN3_EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {QWEN3_EOS}", special_tokens=[(QWEN3_EOS, QWEN3_EOS_ID)]
    )
    # Qwen3-Embedding pads on the left, so its last token is the last column.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=QWEN3_EOS,
        pad_token=QWEN3_EOS,
        padding_side="left",
        model_max_length=max_length,
    )


def build_embedder(name: str, workdir: Path, seed: int = 0) -> Path:
    """The sentence-transformers directory of shape `name` under `workdir`, built once per shape, seed and code:
    a later run with the same spec reuses it (the 0.6B shape takes a minute to build)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model

    shape = EMBED_SHAPES[name]
    spec = {"shape": asdict(shape), "seed": seed, "format": 1}
    directory = workdir / f"{name}-seed{seed}"
    marker = directory / "ferry_bench_spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return directory
    # BERT reads up to its position table; for Qwen3 (32k positions) any limit past the longest input does.
    max_length = int(shape.config["max_position_embeddings"]) if shape.kind == "bert" else 8192
    hidden = int(shape.config["hidden_size"])
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="ferry-embed-build-") as scratch:
        embedder_tokenizer(shape, max_length).save_pretrained(scratch)
        config = BertConfig(**shape.config) if shape.kind == "bert" else Qwen3Config(**shape.config)
        model = BertModel(config) if shape.kind == "bert" else Qwen3Model(config)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, shape.init_std)
        model.to(getattr(torch, shape.checkpoint_dtype)).save_pretrained(scratch)
        del model
        modules: list[torch.nn.Module] = [
            Transformer(scratch, max_seq_length=max_length, model_kwargs={"dtype": shape.checkpoint_dtype}),
            Pooling(hidden, shape.pooling),
        ]
        if shape.normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    marker.write_text(json.dumps(spec))
    return directory


@dataclass(frozen=True)
class EmbedInputs:
    ids: list[list[int]]
    """Each input's token ids, special tokens included: what the servers get."""
    texts: list[str]
    """The same inputs as text (without the special tokens, which the tokenizer adds): what `encode` gets."""

    @property
    def total_tokens(self) -> int:
        return sum(len(ids) for ids in self.ids)


def make_inputs(shape: EmbedShape, count: int, min_len: int, max_len: int, seed: int) -> EmbedInputs:
    """`count` inputs of uniformly drawn length in [min_len, max_len] tokens, special tokens included."""
    rng = random.Random(seed)
    regular = _regular_ids(shape)
    num_specials = 2 if shape.kind == "bert" else 1
    texts, ids = [], []
    for _ in range(count):
        words = [rng.choice(regular) for _ in range(rng.randint(min_len, max_len) - num_specials)]
        texts.append(" ".join(_word(i) for i in words))
        ids.append([_BERT_CLS, *words, _BERT_SEP] if shape.kind == "bert" else [*words, QWEN3_EOS_ID])
    return EmbedInputs(ids, texts)


def check_tokenization(model_dir: Path, inputs: EmbedInputs) -> None:
    """The saved tokenizer turns every text into exactly the ids the servers get, or the systems would embed
    different inputs."""
    from transformers import AutoTokenizer

    tokenized = AutoTokenizer.from_pretrained(model_dir)(inputs.texts)["input_ids"]
    for i, (got, expected) in enumerate(zip(tokenized, inputs.ids, strict=True)):
        if list(got) != expected:
            raise RuntimeError(f"input {i}: the tokenizer gives {list(got)[:8]}..., the servers get {expected[:8]}...")


@dataclass
class SystemResult:
    system: str
    dtype: str
    wall_seconds: float
    vectors: np.ndarray = field(repr=False)
    details: dict[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.system}@{self.dtype}"


class CosineMismatch(RuntimeError):
    """Some system's vectors do not agree with the reference: no figure is reported."""


def parse_system(entry: str, default_dtype: str) -> tuple[str, str]:
    system, _, dtype = entry.partition("@")
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}: one of {', '.join(SYSTEMS)}")
    dtype = dtype or default_dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} in {entry!r}: one of {', '.join(DTYPES)}")
    return system, dtype


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    return machine_busy_seconds()


def _tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process `root` and its descendants, those that exited and were reaped included."""
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command name, which may hold spaces and parentheses itself.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parents[pid] = int(fields[1])
            seconds[pid] = sum(int(v) for v in fields[11:15]) / CLOCK_TICKS  # utime stime cutime cstime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(seconds.get(pid, 0.0) for pid in tree)


@contextlib.contextmanager
def cpu_use() -> Iterator[dict[str, float]]:
    """While the block runs, the cores busy on average in this process and its children (the system measured: the
    bench itself with sentence-transformers, or the server it started) and outside them (other work on the machine,
    which slows every figure): filled into the yielded dict as `own_cores` and `other_cores`."""
    figures: dict[str, float] = {}
    busy, own, start = _busy_cpu_seconds(), _tree_cpu_seconds(os.getpid()), time.perf_counter()
    yield figures
    wall = time.perf_counter() - start
    own_used = _tree_cpu_seconds(os.getpid()) - own
    figures["own_cores"] = own_used / wall
    figures["other_cores"] = max(0.0, (_busy_cpu_seconds() - busy - own_used) / wall)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


# -- sentence-transformers ---------------------------------------------------------------------------------------


def run_sentence_transformers(
    model_dir: Path, inputs: EmbedInputs, warm: EmbedInputs | None, dtype: str, batch_size: int
) -> tuple[float, np.ndarray, dict[str, float]]:
    """Wall seconds and vectors of the timed `encode` (after one untimed on `warm`), and the cores used meanwhile
    (`cpu_use`)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    try:
        if warm is not None:
            model.encode(warm.texts, batch_size=batch_size)
        with cpu_use() as cpu:
            start = time.perf_counter()
            vectors = model.encode(inputs.texts, batch_size=batch_size, convert_to_numpy=True)
            wall = time.perf_counter() - start
    finally:
        del model
        gc.collect()
    return wall, np.asarray(vectors, dtype=np.float32), cpu


# -- servers over HTTP -------------------------------------------------------------------------------------------


def _server_command(
    system: str, model_dir: Path, dtype: str, port: int, options: EmbedOptions, shape: EmbedShape
) -> tuple[list[str], dict[str, str], str]:
    """The command line, environment and readiness path of the server to start."""
    if system == "ferry":
        command = [
            sys.executable, "-m", "ferry", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--dtype", dtype,
            "--max-batch-tokens", str(options.max_batch_tokens),
        ]  # fmt: skip
        if options.threads is not None:
            command += ["--cpu-threads", str(options.threads), "--cpu-prefill-threads", str(options.threads)]
        return [*command, *options.ferry_args], dict(os.environ), "/ready"
    if options.vllm_python is None:
        raise ValueError("the vllm system needs --vllm-python")
    command = [
        str(options.vllm_python.parent / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--no-enable-log-requests", "--runner", "pooling", "--dtype", dtype,
        "--max-model-len", str(options.max_len), "--max-num-batched-tokens", str(options.max_batch_tokens),
    ]  # fmt: skip
    if shape.kind == "qwen3":
        # sentence-transformers saves the decoder as Qwen3Model, which vLLM's registry lacks; the public
        # Qwen3-Embedding checkpoint names Qwen3ForCausalLM (same weights, no LM head), which vLLM pools.
        command += ["--hf-overrides", json.dumps({"architectures": ["Qwen3ForCausalLM"]})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "HF_HUB_OFFLINE": "1"}
    if options.threads is not None:
        # vLLM-CPU binds one OpenMP thread per listed core.
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{options.threads - 1}" if options.threads > 1 else "0"
    return [*command, *options.vllm_args], env, "/health"


async def _embed_request(client: httpx.AsyncClient, url: str, model: str, batch: list[list[int]]) -> np.ndarray:
    body = {"model": model, "input": batch, "encoding_format": "base64"}
    response = await client.post(f"{url}/v1/embeddings", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/embeddings answered HTTP {response.status_code}: {response.text[:500]}")
    data = sorted(response.json()["data"], key=lambda item: item["index"])
    if len(data) != len(batch):
        raise RuntimeError(f"{len(data)} embeddings for {len(batch)} inputs")
    # base64 carries each embedding's float32 bytes, little-endian (OpenAI's format, which both servers send).
    return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in data])


async def _embed_all(
    url: str, inputs: EmbedInputs, warm: EmbedInputs, batch_size: int, concurrency: int, timeout: float
) -> tuple[float, np.ndarray, dict[str, float]]:
    """Closed loop: `concurrency` clients, each sends the next batch of inputs when its last one came back."""
    batches = [inputs.ids[i : i + batch_size] for i in range(0, len(inputs.ids), batch_size)]
    results: list[np.ndarray | None] = [None] * len(batches)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
        # Inputs of their own (another seed): connection set-up and first-request costs stay out of the figure, and
        # no timed input is in a prefix cache.
        await _embed_request(client, url, model, warm.ids)
        next_batch = iter(range(len(batches)))

        async def client_loop() -> None:
            for index in next_batch:  # the shared iterator hands each batch to exactly one client
                results[index] = await _embed_request(client, url, model, batches[index])

        with cpu_use() as cpu:
            start = time.perf_counter()
            await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(batches)))))
            wall = time.perf_counter() - start
    return wall, np.concatenate([r for r in results if r is not None]), cpu


def run_server(
    system: str, model_dir: Path, inputs: EmbedInputs, warm: EmbedInputs, dtype: str, options: EmbedOptions
) -> tuple[float, np.ndarray, dict[str, float], float]:
    """Wall seconds and vectors of the timed inputs, the cores used meanwhile (`cpu_use`: the server's, the
    client's) and the server's start-up seconds."""
    shape = EMBED_SHAPES[options.model]
    port = free_port()
    command, env, ready_path = _server_command(system, model_dir, dtype, port, options, shape)
    log = options.workdir / "logs" / f"{system}-{options.model}-{dtype}.log"
    started = time.perf_counter()
    try:
        with started_server(command, env, f"http://127.0.0.1:{port}", ready_path, options.startup_timeout, log) as url:
            startup = time.perf_counter() - started
            wall, vectors, cpu = asyncio.run(
                _embed_all(url, inputs, warm, options.batch_size, options.concurrency, options.timeout)
            )
    except (RuntimeError, httpx.HTTPError) as exc:
        exc.add_note(f"{system} server log: {log}")
        raise
    return wall, vectors, cpu, startup


# -- the run -----------------------------------------------------------------------------------------------------


def check_indices(inputs: EmbedInputs, count: int) -> list[int]:
    """The shortest and the longest input, and others evenly spaced: `count` distinct inputs (or all)."""
    n = len(inputs.ids)
    lengths = [len(ids) for ids in inputs.ids]
    chosen = [lengths.index(min(lengths)), lengths.index(max(lengths))]
    chosen += [round(i * (n - 1) / max(count - 1, 1)) for i in range(count)]
    return sorted(dict.fromkeys(chosen))[: max(count, 2)]


def compare_vectors(
    results: list[SystemResult], reference: np.ndarray, indices: list[int], min_cosine: float
) -> dict[str, object]:
    """Each system's vectors for `indices` against the float32 reference; raises CosineMismatch unless every cosine
    exceeds `min_cosine` and every vector is nearer its own input's reference than half the way to any other's.

    The second condition is what makes the check able to fail: mean pooling over hundreds of random tokens leaves
    two different inputs' vectors at a cosine near 1 too, so a cosine threshold alone would pass a mixed-up or
    degenerate answer. Distances are relative to the reference vector's length (vLLM normalizes every embedding)."""
    unit_reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    gaps = np.linalg.norm(unit_reference[:, None, :] - unit_reference[None, :, :], axis=2)
    np.fill_diagonal(gaps, np.inf)
    nearest_other = float(gaps.min())
    cosines, errors = {}, {}
    for r in results:
        vectors = r.vectors[indices].astype(np.float64)
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        cosines[r.label] = float((unit * unit_reference).sum(axis=1).min())
        errors[r.label] = float(np.linalg.norm(unit - unit_reference, axis=1).max())
    report = {
        "inputs": indices,
        "reference": "sentence-transformers float32",
        "min_cosine": cosines,
        "max_distance": errors,
        "threshold": min_cosine,
        "nearest_other_input": nearest_other,
    }
    failing = {
        label: cosines[label]
        for label in cosines
        if not (cosines[label] > min_cosine and errors[label] < nearest_other / 2)
    }
    if failing:
        raise CosineMismatch(
            f"vectors differ from the float32 reference: cosine at most {min_cosine} or distance at least half the "
            f"{nearest_other:.4g} between two different inputs, for {failing} (distances {errors})"
        )
    return report


def run_embed(options: EmbedOptions) -> dict[str, object]:
    if options.model not in EMBED_SHAPES:
        raise ValueError(f"unknown model {options.model!r}: one of {', '.join(EMBED_SHAPES)}")
    shape = EMBED_SHAPES[options.model]
    entries = [parse_system(entry, options.dtype) for entry in options.systems]
    runs = [(system, shape.checkpoint_dtype if dtype == "auto" else dtype) for system, dtype in entries]
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model_dir = build_embedder(options.model, options.workdir, options.seed)
    inputs = make_inputs(shape, options.num_inputs, options.min_len, options.max_len, options.seed)
    warm = make_inputs(shape, options.batch_size, options.min_len, options.max_len, options.seed + 1)
    check_tokenization(model_dir, inputs)

    results: list[SystemResult] = []
    skipped: dict[str, str] = {}
    for system, dtype in runs:
        if system == "vllm" and options.vllm_python is None:
            skipped[f"{system}@{dtype}"] = "no --vllm-python given"
            continue
        if system == "st":
            wall, vectors, cpu = run_sentence_transformers(model_dir, inputs, warm, dtype, options.batch_size)
            details: dict[str, object] = {"batch_size": options.batch_size, "torch_threads": torch.get_num_threads()}
        else:
            wall, vectors, cpu, startup = run_server(system, model_dir, inputs, warm, dtype, options)
            details = {
                "startup_seconds": startup,
                "inputs_per_request": options.batch_size,
                "concurrency": options.concurrency,
                "max_batch_tokens": options.max_batch_tokens,
            }
        details.update(cpu, load_average_after=list(os.getloadavg()))
        results.append(SystemResult(system, dtype, wall, vectors, details))

    indices = check_indices(inputs, options.check_inputs)
    subset = EmbedInputs([inputs.ids[i] for i in indices], [inputs.texts[i] for i in indices])
    _, reference, _ = run_sentence_transformers(model_dir, subset, None, "float32", options.batch_size)
    check = compare_vectors(results, reference, indices, options.min_cosine)

    ferry = next((r for r in results if r.system == "ferry"), None)
    systems = {
        r.label: {
            "system": r.system,
            "dtype": r.dtype,
            "wall_seconds": r.wall_seconds,
            "embeddings_per_second": len(inputs.ids) / r.wall_seconds,
            "tokens_per_second": inputs.total_tokens / r.wall_seconds,
            "ferry_ratio": (r.wall_seconds / ferry.wall_seconds) if ferry is not None else None,
            "details": r.details,
        }
        for r in results
    }
    lengths = [len(ids) for ids in inputs.ids]
    return {
        "benchmark": "embed",
        **stamp(),
        "cpu_model": cpu_model(),
        "model": options.model,
        "model_dir": str(model_dir),
        "shape": asdict(shape),
        "inputs": {
            "count": len(inputs.ids),
            "length": f"uniform:{options.min_len}:{options.max_len}",
            "seed": options.seed,
            "total_tokens": inputs.total_tokens,
            "mean_tokens": inputs.total_tokens / len(inputs.ids),
            "min_tokens": min(lengths),
            "max_tokens": max(lengths),
        },
        "threads": options.threads,
        "systems": systems,
        "skipped": skipped,
        "check": check,
    }


def format_embed(report: dict[str, object]) -> str:
    inputs = report["inputs"]
    systems = report["systems"]
    headers = ["system", "dtype", "wall s", "emb/s", "tok/s", "Ferry / this", "cores used", "other load"]
    rows = []
    for s in systems.values():
        details = s["details"]
        ratio = s["ferry_ratio"]
        rows.append(
            [
                s["system"],
                s["dtype"],
                fmt(s["wall_seconds"]),
                fmt(s["embeddings_per_second"]),
                fmt(s["tokens_per_second"], 0),
                "" if ratio is None or s["system"] == "ferry" else f"{ratio:.2f}x",
                fmt(details["own_cores"]),
                fmt(details["other_cores"]),
            ]
        )
    check = report["check"]
    cosines = ", ".join(
        f"{label} {value:.6f} ({check['max_distance'][label]:.2g})" for label, value in check["min_cosine"].items()
    )
    lines = [
        f"ferry bench embed: {report['model']}, {inputs['count']} inputs of {inputs['length']} tokens "
        f"({inputs['total_tokens']:,} in all, seed {inputs['seed']}); {report['cpu_model']}, "
        f"threads {report['threads'] if report['threads'] is not None else 'each system’s default'}",
        format_table(headers, rows),
        "cores used: the system's processes (a server's with the bench's client) on average while timed; other load: "
        "the machine's other busy cores meanwhile",
        f"vectors against sentence-transformers float32 over {len(check['inputs'])} inputs, min cosine (max distance "
        f"of unit vectors): {cosines}; two different inputs lie {check['nearest_other_input']:.2g} apart at least",
    ]
    lines += [f"{label} skipped: {why}" for label, why in report["skipped"].items()]
    return "\n".join(lines)
