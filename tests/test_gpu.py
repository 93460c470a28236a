"""GPU-only paths: skipped on CPU, run by scripts/gpu_bench.sh on a CUDA machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.attention import TorchPagedBackend
from engine.attention.flash import FlashBackend, flash_available
from engine.core.observer import StepRecord
from engine.core.request import LoRARequest
from engine.execution.cuda_graphs import graph_sizes, max_graph_size
from engine.execution.kv_caches import kv_cache_groups
from engine.execution.memory import decode_graph_bytes
from engine.models.loader import LoadedModel, load_model
from tests.capturable_backend import DensePagedBackend
from tests.test_attention import attention_runner, fresh_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    ("backend", "page_size", "async_scheduling"),
    [("torch", 4, False), ("triton", 16, False), ("triton", 16, True)],
    ids=["torch", "triton-graphs", "triton-graphs-async"],
)
def test_cuda_engine_greedy_equals_generate(
    model_dir: Callable[[str], Path], backend: str, page_size: int, async_scheduling: bool
) -> None:
    """Against transformers on the same device in float32: pinned staging buffers and async copies with the torch
    backend; the Triton kernel at the default page size (prefill chunks over cached pages, decodes replayed from
    CUDA graphs); and the same with steps planned and prepared while the one before runs."""
    if backend == "triton":
        pytest.importorskip("triton")
    path = model_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    prompts = [[10 + (i * 7 + j) % 300 for j in range(5 + 9 * i)] for i in range(8)]
    expected = [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    config = EngineConfig.of(
        model=str(path),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        page_size=page_size,
        num_pages=256,
        max_batch_tokens=32,
        async_scheduling=async_scheduling,
        debug_checks=True,
    )
    with EngineCore(config) as engine:
        assert engine.runner.backend.name == backend
        assert bool(engine.runner.graph_sizes) == (backend == "triton"), "graphs wherever the backend is capturable"
        results = generate_batch(prompts, params=SamplingParams(max_new_tokens=12), engine=engine)
        assert [results[f"req_{i}"].generated_ids for i in range(len(prompts))] == expected
        assert engine.is_idle_and_clean()


class _Shapes(torch.nn.Module):
    """Just the attributes ModelRunner sizes its cache from."""

    num_layers, num_kv_heads, head_dim = 1, 2, 64


@pytest.mark.skipif(not flash_available(), reason="needs flash-attn")
def test_flash_backend_matches_torch_backend() -> None:
    page, heads = 256, 8
    runner = attention_runner(
        _Shapes(), 12, page, device=torch.device("cuda"), dtype=torch.bfloat16, max_model_len=2048
    )
    # A fresh prompt, a decode deep into its context, and a chunk over cached history: every kind of sequence.
    shapes = [(0, 100), (600, 1), (300, 80)]
    pages = iter(range(12))
    tables = [[next(pages) for _ in range(-(-(computed + new) // page))] for computed, new in shapes]
    inputs = runner.prepare(fresh_plan(shapes, tables))
    total = sum(n for _, n in shapes)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for h in (heads, 2, 2)
    )
    history = [
        torch.randn(c.shape, device="cuda", dtype=torch.bfloat16, generator=generator) for c in runner.kv_caches[0]
    ]
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)], device="cuda")
    # Plain, with a sliding window, with soft-capped scores, and with ALiBi biases: flash-attn's own arguments
    # must compute what the torch backend (checked against float64 in test_attention.py) computes.
    variants = [(None, None, None), (64, None, None), (None, 2.0, None), (None, None, slopes)]
    for window, softcap, alibi_slopes in variants:
        outputs = []
        for backend in (TorchPagedBackend(), FlashBackend(page)):
            cache = (history[0].clone(), history[1].clone())
            inputs.meta.backend_state.clear()
            backend.prepare(inputs.meta)
            outputs.append(
                backend.forward(
                    q, k, v, cache, inputs.meta, 64**-0.5, window, softcap=softcap, alibi_slopes=alibi_slopes
                )
            )
        torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)


# float32: well below what TF32 products would miss by (~1e-3), above the GPU's approximate exp2 over 600 keys.
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype, tolerance: float) -> None:
    """At page size 16, every kind of sequence in one step, plain and with each feature; then a decode-only step
    (the kernel's other grid)."""
    triton_paged = pytest.importorskip("engine.attention.triton_paged")
    page, heads = 16, 8
    generator = torch.Generator(device="cuda").manual_seed(0)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)], device="cuda")
    variants = [(None, None, None), (64, None, None), (None, 2.0, None), (None, None, slopes)]
    for shapes in ([(0, 100), (600, 1), (300, 80), (33, 1), (0, 1)], [(600, 1), (33, 1), (250, 1), (0, 1)]):
        runner = attention_runner(_Shapes(), 80, page, device=torch.device("cuda"), dtype=dtype, max_model_len=2048)
        history = [torch.randn(c.shape, device="cuda", dtype=dtype, generator=generator) for c in runner.kv_caches[0]]
        pages = iter(range(80))
        tables = [[next(pages) for _ in range(-(-(computed + new) // page))] for computed, new in shapes]
        meta = runner.prepare(fresh_plan(shapes, tables)).meta
        total = sum(n for _, n in shapes)
        q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=dtype, generator=generator) for h in (heads, 2, 2))
        for window, softcap, alibi_slopes in variants:
            outputs = []
            for backend in (TorchPagedBackend(), triton_paged.TritonPagedBackend()):
                cache = (history[0].clone(), history[1].clone())
                meta.backend_state.clear()
                outputs.append(
                    backend.forward(q, k, v, cache, meta, 64**-0.5, window, softcap=softcap, alibi_slopes=alibi_slopes)
                )
            torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)


def test_cuda_kv_cache_takes_the_memory_flag_after_the_profiled_step(model_dir: Callable[[str], Path]) -> None:
    """The cache gets max_memory_percent of the memory free after loading, less the largest step's activations,
    and the largest step still runs once the cache holds its share."""
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    config = EngineConfig.of(
        model=str(model_dir("llama")), device="cuda", dtype="bfloat16", max_memory_percent=0.05, max_batch_tokens=512
    )
    engine = EngineCore(config)
    kv_bytes = sum(2 * k.numel() * k.element_size() for k, _ in engine.runner.kv_caches)
    assert 0 < kv_bytes <= 0.05 * free_before
    prompts = [[10 + (i + j) % 300 for j in range(64)] for i in range(8)]
    results = generate_batch(prompts, params=SamplingParams(max_new_tokens=4), engine=engine)
    assert all(len(r.generated_ids) == 4 for r in results.values())


def test_flash_attention_refuses_float32_when_chosen(model_dir: Callable[[str], Path]) -> None:
    config = EngineConfig.of(model=str(model_dir("llama")), device="cuda", dtype="float32", attention_backend="flash")
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        EngineCore(config)


# -- CUDA graphs (engine/execution/cuda_graphs.py) ---------------------------------------------------------------------

_GRAPH_PROMPTS = [[10 + (i * 7 + j) % 300 for j in range(5 + 9 * i)] for i in range(8)]
_GRAPH_PARAMS = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]


def _graph_config(path: Path, **options: object) -> EngineConfig:
    # max_batch_tokens 32 chunks the prompts, so eager mixed steps come between replayed decode steps; 8 sequences
    # at most, so graphs of 1, 2, 4 and 8 sequences, each replayed as the batch drains.
    defaults = dict(model=str(path), device="cuda", dtype="float32", page_size=4, max_batch_tokens=32, max_num_seqs=8)
    return EngineConfig.of(**{**defaults, **options})  # type: ignore[arg-type]


def _with_backend(loaded: LoadedModel, backend: DensePagedBackend) -> LoadedModel:
    return dataclasses.replace(loaded, backend=backend)


def _greedy(engine: EngineCore) -> list[list[int]]:
    results = generate_batch(_GRAPH_PROMPTS, params=_GRAPH_PARAMS, engine=engine)
    assert engine.is_idle_and_clean()
    return [results[f"req_{i}"].generated_ids for i in range(len(_GRAPH_PROMPTS))]


def test_cuda_graphs_replay_the_eager_tokens(model_dir: Callable[[str], Path]) -> None:
    """Decode steps replayed from graphs (a capturable backend, the KV budget measured with the graphs' memory)
    generate what --enforce-eager generates, in float32; capture is quick and its memory was accounted for."""
    config = _graph_config(model_dir("llama"), max_memory_percent=0.02)
    loaded = _with_backend(load_model(config), DensePagedBackend())
    eager = EngineCore(config.replace(enforce_eager=True), loaded=loaded)
    assert eager.cuda_graphs is None
    expected = _greedy(eager)
    del eager
    layouts = kv_cache_groups(loaded.model, config.cache.page_size)
    estimate = decode_graph_bytes(config, loaded, layouts)
    engine = EngineCore(config, loaded=loaded)
    report = engine.cuda_graphs
    assert report is not None and report.sizes == graph_sizes(max_graph_size(config)) == (1, 2, 4, 8)
    assert report.seconds < 30
    assert 0 < report.pool_bytes <= 1.5 * estimate + 64 * 2**20, (report.pool_bytes, estimate)
    assert _greedy(engine) == expected


def test_lora_adapters_through_cuda_graphs_equal_peft(model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Four adapters and the base mixed (torch's masked matmuls on CUDA), decodes replayed from the base and the
    adapted graphs: each request's greedy tokens equal PEFT's on the same GPU in float32, and --enforce-eager's."""
    pytest.importorskip("peft")
    from tests.lora_adapters import build_adapters, peft_model

    path = model_dir("llama")
    names = ["attn-r8", "mlp-r4", "all-r16", "qv-r16-rslora"]
    adapters = build_adapters(path, tmp_path, names)
    loras = [None, *(LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(names))]
    prompts = [[7 + 13 * i + j for j in range(6 + 5 * i)] for i in range(len(loras))]
    params = SamplingParams(max_new_tokens=10)
    config = _graph_config(path, enable_lora=True, max_loras=4, max_memory_percent=0.05)
    loaded = _with_backend(load_model(config), DensePagedBackend())
    outputs = []
    for eager in (True, False):
        with EngineCore(config.replace(enforce_eager=eager), loaded=loaded) as engine:
            assert (engine.cuda_graphs is None) == eager
            results = generate_batch(prompts, params=params, engine=engine, loras=loras)
            assert engine.is_idle_and_clean()
        outputs.append([results[f"req_{i}"].generated_ids for i in range(len(prompts))])
    assert outputs[0] == outputs[1], "graphs and eager steps disagree"
    for i, lora in enumerate(loras):
        model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if lora is None
            else peft_model(path, adapters[lora.name])
        ).cuda()
        want = model.generate(torch.tensor([prompts[i]], device="cuda"), max_new_tokens=10, do_sample=False)
        assert outputs[1][i] == want[0, len(prompts[i]) :].tolist(), lora


def test_cuda_graphs_keep_real_pages_clean(model_dir: Callable[[str], Path]) -> None:
    """Padded rows write the scratch page only: after padded decode steps every page the pool never handed out is
    still zero, and the scratch page was written."""
    handed: set[int] = set()

    class Pages:
        def on_step(self, record: StepRecord) -> None:
            for new in record.plan.new_requests:
                handed.update(new.page_tables[0])
            for _, grant in record.plan.new_pages:
                handed.update(grant[0])

    config = _graph_config(model_dir("llama"), num_pages=256)
    engine = EngineCore(config, loaded=_with_backend(load_model(config), DensePagedBackend()), observers=[Pages()])
    assert engine.cuda_graphs is not None
    # Three sequences: every decode step pads to 4.
    generate_batch(_GRAPH_PROMPTS[:3], params=_GRAPH_PARAMS[:3], engine=engine)
    scratch = engine.runner.scratch_pages[0]
    untouched = sorted(set(range(scratch)) - handed)
    assert untouched and scratch not in handed
    for k_cache, v_cache in engine.runner.kv_caches:
        assert k_cache[untouched].abs().sum().item() == v_cache[untouched].abs().sum().item() == 0
        assert k_cache[scratch, 0].abs().sum().item() > 0


def test_cuda_graphs_with_the_chosen_backend(model_dir: Callable[[str], Path]) -> None:
    """With the backend `auto` picks, where it is capturable: graphs against --enforce-eager, greedy."""
    config = _graph_config(model_dir("llama"), num_pages=256)
    engine = EngineCore(config)
    if not engine.runner.backend.capturable:
        pytest.skip(f"the {engine.runner.backend.name} backend is not capturable: every step runs eagerly")
    assert engine.cuda_graphs is not None
    expected = _greedy(EngineCore(config.replace(enforce_eager=True)))
    assert _greedy(engine) == expected


def test_fp8_weights_through_scaled_matmuls_match_their_dequantized_reference(model_dir: Callable[[str], Path]) -> None:
    """--quantization fp8 on the GPU (e4m3 weights and activations, `torch._scaled_mm` with a scale per row of
    each), CUDA graphs on, against transformers in float32 on the CPU over the weights Ferry dequantizes, with
    its activations quantized the same way; float32, and bfloat16 generating through the rowwise-scaled path.

    The tolerance is e4m3's, not float32's: cuBLAS sums in another order than the CPU, so an activation a few ulps
    away from a rounding boundary of e4m3 (whose steps are 1/16 of the value) lands on its other side in one system
    and not the other; on the tiny model's sharp logits a few such flips moved a chosen token's logprob by 0.11 on
    the H200 (float32: 0.11 and 0.26 in two runs; 0.34 in bfloat16), where on the CPU, whose sums are the
    reference's, nothing flips (2e-6). So the bound on each position is loose and the mean is held tight: a wrong
    scale or layout is off by whole nats everywhere."""
    from tests.quantized_reference import check_against, prompts_for, reference_model

    path = model_dir("llama")
    config = EngineConfig.of(
        model=str(path), device="cuda", dtype="float32", quantization="fp8", attention_backend="triton",
        page_size=16, num_pages=256, max_batch_tokens=64,
    )  # fmt: skip
    with EngineCore(config) as engine:
        assert engine.cuda_graphs is not None
        model = engine.runner.model
        prompts, max_new = prompts_for(model.config.vocab_size, shared_prefix=0)
        params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
        results = generate_batch(prompts, params=params, engine=engine)
        reference = reference_model(path, model, "fp8")
    check_against(reference, prompts, results, "fp8/cuda", tolerance=0.5, mean_tolerance=0.02)
    with EngineCore(config.replace(dtype="bfloat16")) as engine:
        bf16 = generate_batch(prompts, params=params, engine=engine)
    assert all(bf16[f"req_{i}"].generated_ids for i in range(len(prompts)))


# -- a float8 KV cache (--kv-cache-dtype fp8) ---------------------------------------------------------------------

_FP8_PROMPTS = [[10 + (i * 7 + j) % 300 for j in range(5 + 9 * i)] for i in range(8)]


def _float8_triton_or_skip() -> None:
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts float8 e4m3 on compute capability 8.9 and up")


def test_triton_over_float8_pages_matches_the_torch_backend() -> None:
    """bfloat16 queries over e4m3 pages written with scales (the history by `write_kv`, the step's K/V by each
    backend): every kind of sequence in one step, the Triton kernel against the torch backend's dequantizing
    gather, within bfloat16's rounding."""
    _float8_triton_or_skip()
    from engine.attention.base import write_kv
    from engine.attention.triton_paged import TritonPagedBackend

    page, heads, num_pages = 16, 8, 80
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    runner = attention_runner(_Shapes(), num_pages, page, device=device, dtype=torch.bfloat16, max_model_len=2048)
    shapes = [(0, 100), (600, 1), (300, 80), (33, 1), (0, 1)]
    pages = iter(range(num_pages))
    tables = [[next(pages) for _ in range(-(-(computed + new) // page))] for computed, new in shapes]
    meta = runner.prepare(fresh_plan(shapes, tables)).meta
    history = [torch.randn(num_pages * page, 2, 64, device=device, generator=generator) for _ in range(2)]
    total = sum(n for _, n in shapes)
    q, k, v = (
        torch.randn(total, h, 64, device=device, generator=generator, dtype=torch.bfloat16) for h in (heads, 2, 2)
    )
    outputs = []
    for backend in (TorchPagedBackend(), TritonPagedBackend()):
        cache = tuple(torch.zeros(num_pages, page, 2, 64, dtype=torch.float8_e4m3fn, device=device) for _ in range(2))
        write_kv(*history, cache, torch.arange(num_pages * page, device=device), 0.5, 0.25)
        meta.backend_state.clear()
        outputs.append(backend.forward(q, k, v, cache, meta, 64**-0.5, None, k_scale=0.5, v_scale=0.25))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)


def test_float8_cache_through_triton_and_graphs_generates_the_torch_backends_tokens(
    model_dir: Callable[[str], Path],
) -> None:
    """The engine with --kv-cache-dtype fp8 in float32: the Triton kernel with decode steps replayed from CUDA
    graphs against the torch backend run eagerly over the same e4m3 rounding (`write_kv`). Greedy tokens equal;
    logprobs within 5e-3, since K/V computed a few ulps apart may round to neighbouring e4m3 values
    (tests/test_kv_cache_fp8.py)."""
    _float8_triton_or_skip()
    options = dict(
        model=str(model_dir("llama")), device="cuda", dtype="float32", kv_cache_dtype="fp8", page_size=16,
        num_pages=256, max_batch_tokens=32, max_num_seqs=8, cuda_graph_max_seqs=8,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=12, logprobs=True, ignore_eos=True)
    runs = {}
    for backend in ("triton", "torch"):
        with EngineCore(EngineConfig.of(**options, attention_backend=backend)) as engine:
            assert engine.kv_cache_dtype == "float8_e4m3fn"
            assert (engine.cuda_graphs is not None) == (backend == "triton"), "graphs where the backend is capturable"
            results = generate_batch(_FP8_PROMPTS, params=params, engine=engine)
            assert engine.is_idle_and_clean()
        runs[backend] = [results[f"req_{i}"] for i in range(len(_FP8_PROMPTS))]
    for i, (got, want) in enumerate(zip(runs["triton"], runs["torch"], strict=True)):
        assert got.generated_ids == want.generated_ids, f"request {i}"
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        assert worst <= 5e-3, f"request {i}: a logprob is {worst:.2e} off"


@pytest.mark.parametrize("builder", ["bert", "modernbert", "qwen3"])
def test_pooling_on_cuda_matches_sentence_transformers(tmp_path: Path, builder: str) -> None:
    """Embeddings on the GPU (the memory profile runs pooling steps for a model that does not generate; the Triton
    kernel reads an encoder's span intervals, ModernBERT's windowed ones included) against sentence-transformers on
    the CPU in float32."""
    import numpy as np

    from engine.api import pool_batch

    # Before the builders, which save their models with it: the GPU machine's interpreter may not have it.
    SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer
    from tests.pooling_models import build_bert_embedder, build_modernbert_embedder, build_qwen3_embedder

    build = {"bert": build_bert_embedder, "modernbert": build_modernbert_embedder, "qwen3": build_qwen3_embedder}
    path = build[builder](tmp_path / builder)
    model = SentenceTransformer(str(path), device="cpu")
    texts = ["a ferry waits for no one", "the harbour opens at dawn and closes at dusk " * 6, "x"]
    expected = model.encode(texts, convert_to_numpy=True)
    tokenizer = model[0].tokenizer
    ids = [tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"] for text in texts]
    config = EngineConfig.of(model=str(path), device="cuda", dtype="float32", num_pages=256)
    got = np.asarray(pool_batch(ids, config))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_on_cuda_equals_generate_and_replays_from_graphs(model_dir: Callable[[str], Path], arch: str) -> None:
    """Native experts (grouped matmuls with the experts' offsets on the device) on the GPU: float32 greedy tokens
    equal transformers' there, with the Triton kernel and decode replayed from CUDA graphs; bfloat16 graphs replay
    what --enforce-eager generates."""
    pytest.importorskip("triton")
    path = model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    prompts = [[10 + (i * 7 + j) % 300 for j in range(5 + 9 * i)] for i in range(6)]
    expected = [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    params = SamplingParams(max_new_tokens=12)
    for dtype in ("float32", "bfloat16"):
        outputs = {}
        for eager in (False, True):
            config = EngineConfig.of(
                model=str(path), device="cuda", dtype=dtype, attention_backend="triton", page_size=16,
                num_pages=256, max_batch_tokens=32, enforce_eager=eager,
            )  # fmt: skip
            with EngineCore(config) as engine:
                assert bool(engine.runner.graph_sizes) != eager
                results = generate_batch(prompts, params=params, engine=engine)
                outputs[eager] = [results[f"req_{i}"].generated_ids for i in range(len(prompts))]
        assert outputs[False] == outputs[True], f"{dtype}: graphs and eager disagree"
        if dtype == "float32":
            assert outputs[False] == expected


@pytest.mark.parametrize("arch", ["mamba2", "jamba"])
def test_state_space_on_cuda_equals_generate(model_dir: Callable[[str], Path], arch: str) -> None:
    """The state-space layers' torch path (the CPU kernels' reference) on a GPU, eagerly (no graphs for them):
    float32 greedy tokens equal transformers' on the same device, prompts chunked and mixed with decodes."""
    path = model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    prompts = [[10 + (i * 7 + j) % 300 for j in range(5 + 9 * i)] for i in range(8)]
    expected = [
        hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    config = EngineConfig.of(
        model=str(path), device="cuda", dtype="float32", num_pages=256, max_batch_tokens=32, debug_checks=True
    )
    with EngineCore(config) as engine:
        assert engine.cuda_graphs is None
        results = generate_batch(prompts, params=SamplingParams(max_new_tokens=12), engine=engine)
    assert [results[f"req_{i}"].generated_ids for i in range(len(prompts))] == expected
