"""Quantized weights (`--quantization`), against the oracle: the model's own forward pass (transformers, float32)
over the very weights Ferry multiplies by, dequantized, with the activations quantized as Ferry quantizes them for
the schemes that do (int8-dynamic, fp8).

Ferry's tokens are fed back to the reference (teacher forcing), so one near-tie cannot make the rest of a sequence
incomparable: at every generated position the chosen token's logprob lies within `LOGPROB_TOLERANCE` of the
reference's, and the token is the reference's argmax wherever the reference's best two are further apart than
that. Mixed batches, chunked prefill, preemption, prefix sharing, and tensor parallelism (whose ranks quantize
before slicing: the same codes and scales as one rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.config import ModelConfig
from engine.kernels.quant_linear import symmetric_int8
from engine.layers.linear import LinearBase
from engine.models.loader import load_model, weight_bytes
from engine.quantization import QuantizedLinearMethod, UnsupportedQuantization, fp8, quantized_linear_method
from tests.model_factory import build_model_dir
from tests.quantized_reference import check_against, prompts_for, reference_model, tolerance_of
from tests.server_harness import REPO_ROOT, metric, metric_samples, running_server

SCHEMES = ["int8", "int8-dynamic", "int4", "fp8"]
GROUP_SIZE = 32  # the tiny models' widths are 64 and 128: 128-wide groups would leave one group per row


def _quantized_layers(model: nn.Module) -> dict[str, LinearBase]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LinearBase) and isinstance(module.method, QuantizedLinearMethod)
    }


SETUPS: dict[str, dict] = {
    "mixed": dict(max_batch_tokens=96, page_size=16, num_pages=256),
    "chunked": dict(max_batch_tokens=16, page_size=16, num_pages=256),
    "preempt": dict(max_batch_tokens=256, page_size=4, num_pages=24),
    "prefix": dict(max_batch_tokens=64, page_size=4, num_pages=256),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_engine_matches_the_dequantized_reference(
    model_dir: Callable[[str], Path], scheme: str, setup: str
) -> None:
    path = model_dir("llama")
    config = EngineConfig.of(
        model=str(path), dtype="float32", quantization=scheme, quantization_group_size=GROUP_SIZE,
        debug_checks=True, **SETUPS[setup],
    )  # fmt: skip
    engine = EngineCore(config)
    model = engine.runner.model
    layers = _quantized_layers(model)
    head_quantized = scheme != "fp8"  # the CPU schemes keep the LM head in int8; fp8 in the model's dtype
    assert len(layers) == 4 * model.config.num_hidden_layers + head_quantized, "every decoder linear (and the head)"
    assert isinstance(model.lm_head.method, QuantizedLinearMethod) == head_quantized
    prompts, max_new = prompts_for(model.config.vocab_size, shared_prefix=20 if setup == "prefix" else 0)
    params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
    results = generate_batch(prompts, params=params, engine=engine)
    check_against(reference_model(path, model, scheme), prompts, results, f"{scheme}/{setup}", tolerance_of(scheme))
    assert engine.is_idle_and_clean()
    if setup == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if setup == "prefix":
        assert engine.kv_cache.prefix_hits > 0
    engine.close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_tied_embedding_reads_its_rows_from_the_int8_head(tmp_path: Path, scheme: str) -> None:
    """A tied model keeps one matrix, in the head's int8 layout; the embedding's rows are the head's dequantized
    rows, so the reference (whose head and embedding are one parameter) holds them too."""
    path = build_model_dir(tmp_path, "llama", tie_word_embeddings=True)
    config = EngineConfig.of(
        model=str(path), dtype="float32", quantization=scheme, quantization_group_size=GROUP_SIZE, num_pages=256
    )
    with EngineCore(config) as engine:
        model = engine.runner.model
        head, embedding = model.lm_head, model.model.embed_tokens
        ids = torch.arange(model.config.vocab_size)
        assert torch.equal(embedding(ids), head.method.dequantized_weight(head)[: len(ids)])
        assert not any(t.dim() == 2 and t.is_floating_point() for t in embedding.parameters())
        prompts, max_new = prompts_for(model.config.vocab_size, shared_prefix=0)
        params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
        results = generate_batch(prompts, params=params, engine=engine)
        check_against(reference_model(path, model, scheme), prompts, results, f"{scheme}/tied")


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_hold_slices_of_the_same_quantized_model(model_dir: Callable[[str], Path]) -> None:
    """Each rank quantizes whole checkpoint tensors and keeps its slice of codes and scales (a row-parallel
    layer's scales per output channel on every rank, its groups of columns split): TP=2 computes from the same
    dequantized model as one rank, so it answers as the one-rank reference, for every scheme at once (one
    engine per scheme would start ranks four times)."""
    path = model_dir("llama")
    for scheme in ("int8", "int4"):
        one_rank = load_model(
            EngineConfig.of(model=str(path), dtype="float32", quantization=scheme, quantization_group_size=GROUP_SIZE)
        ).model
        prompts, max_new = prompts_for(one_rank.config.vocab_size, shared_prefix=16)
        config = EngineConfig.of(
            model=str(path), dtype="float32", quantization=scheme, quantization_group_size=GROUP_SIZE,
            tensor_parallel_size=2, max_batch_tokens=32, page_size=4, num_pages=None,
            cpu_kv_cache_gib=48 * 1024 / 2**30,
        )  # fmt: skip
        params = [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new]
        with EngineCore(config) as engine:
            results = generate_batch(prompts, params=params, engine=engine)
            assert engine.scheduler.num_preemptions > 0
        check_against(reference_model(path, one_rank, scheme), prompts, results, f"{scheme}/tp2")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_shrink_by_the_scheme(model_dir: Callable[[str], Path], scheme: str) -> None:
    """The decoder's linears hold their codes (and scales), not a full-precision copy beside them."""
    path = model_dir("llama")
    plain = load_model(EngineConfig.of(model=str(path), dtype="float32")).model
    quantized = load_model(
        EngineConfig.of(model=str(path), dtype="float32", quantization=scheme, quantization_group_size=GROUP_SIZE)
    ).model
    linears = sum(m.input_size * m.output_size for m in _quantized_layers(quantized).values())
    bits = {"int8": 8, "int8-dynamic": 8, "int4": 4, "fp8": 8}[scheme]
    saved = weight_bytes(plain) - weight_bytes(quantized)
    assert saved >= linears * (4 - bits / 8) * 0.85, "float32 linears became codes (scales cost the rest)"
    for layer in _quantized_layers(quantized).values():
        assert not any(p.is_floating_point() and p.dim() == 2 for p in layer.parameters()), "no float weight left"


def test_dummy_weights_quantize_too(model_dir: Callable[[str], Path]) -> None:
    config = EngineConfig.of(model=str(model_dir("llama")), load_format="dummy", quantization="int4",
                             quantization_group_size=GROUP_SIZE, num_pages=64)  # fmt: skip
    results = generate_batch([[5, 6, 7]], config, params=[SamplingParams(max_new_tokens=4, ignore_eos=True)])
    assert len(results["req_0"].generated_ids) == 4


@pytest.mark.parametrize(
    ("arch", "options", "match"),
    [
        ("gpt2", dict(quantization="int8"), r"--quantization int8: .*'gpt2' model runs on the transformers adapter"),
        ("llama", dict(quantization="int4", quantization_group_size=128), r"layer model\.layers\.0\..*groups of 128"),
    ],
)
def test_what_a_scheme_cannot_take_is_refused_by_name(
    model_dir: Callable[[str], Path], arch: str, options: dict, match: str
) -> None:
    with pytest.raises(UnsupportedQuantization, match=match):
        load_model(EngineConfig.of(model=str(model_dir(arch)), **options))


def test_fp8_refuses_sizes_scaled_matmuls_cannot_take(tmp_path: Path) -> None:
    path = build_model_dir(tmp_path, "llama", intermediate_size=72)
    with pytest.raises(UnsupportedQuantization, match=r"--quantization fp8: layer .*mlp.* multiples of 16"):
        load_model(EngineConfig.of(model=str(path), quantization="fp8"))


@pytest.mark.parametrize("scheme", ["int8", "int8-dynamic", "int4"])
def test_cpu_schemes_are_refused_on_a_gpu(scheme: str) -> None:
    with pytest.raises(UnsupportedQuantization, match=rf"--quantization {scheme}: its kernels run on CPU"):
        quantized_linear_method(ModelConfig(path="unused", quantization=scheme), torch.device("cuda"))


def test_the_flag_is_listed() -> None:
    result = subprocess.run([sys.executable, "-m", "ferry", "serve", "--help"], capture_output=True, text=True)
    assert "--quantization" in result.stdout and "int8-dynamic" in result.stdout


# ----------------------------------------------------------------------------------------------- the codes


_rows = st.integers(1, 6)
_groups = st.integers(1, 3)


@settings(max_examples=40, deadline=None)
@given(
    out=_rows, groups=_groups, group=st.sampled_from([32, 64]), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3)
)
def test_codes_round_trip_within_half_a_step(out: int, groups: int, group: int, seed: int, spread: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, groups * group, generator=generator) * spread

    q8, s8 = symmetric_int8(weight)
    assert q8.abs().max() <= 127
    assert ((q8.float() * s8[:, None] - weight).abs() <= s8[:, None] / 2 * (1 + 1e-5)).all()

    q, s = fp8.quantize_fp8(weight)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value, or half the smallest subnormal step.
    bound = torch.maximum(weight.abs() / 16, s[:, None] * 2.0**-10)
    assert ((fp8.dequantize_fp8(q, s) - weight).abs() <= bound * (1 + 1e-5)).all()


def test_a_row_of_zeros_comes_back_as_zeros() -> None:
    weight = torch.zeros(2, 64)
    q8, s8 = symmetric_int8(weight)
    assert torch.equal(q8.float() * s8[:, None], weight)
    assert torch.equal(fp8.dequantize_fp8(*fp8.quantize_fp8(weight)), weight)


# ---------------------------------------------------------------------------------------------- the memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_load_peaks_near_its_quantized_weights(
    tmp_path_factory: pytest.TempPathFactory, scheme: str
) -> None:
    """A bfloat16 checkpoint of ~230M parameters loads as int8 (int4): the process grows by about the quantized
    weights (codes, scales, and the unquantized embedding and head), never by the bfloat16 model: each checkpoint
    tensor is quantized as it arrives. Measured in a fresh process, from anonymous memory."""
    model = _mid_model(tmp_path_factory)
    result = subprocess.run(
        [sys.executable, "scripts/load_peak_memory.py", str(model), "--dtype", "bfloat16", "--quantization", scheme],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["weights_bytes"] > 300 * 2**20, "at least 150M parameters"
    assert measured["loaded_bytes"] < 0.65 * measured["weights_bytes"]
    assert measured["peak_anon_bytes"] < 1.3 * measured["loaded_bytes"], measured


_MID_MODEL: list[Path] = []


def _mid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of ~230M parameters, random bfloat16 weights (built once per session: saving it takes seconds). Many
    narrow layers, as real models have: one layer's weight, the only part ever held in bfloat16 while int4 loads, is
    a few percent of the model (gate/up: 4% of its int4 bytes)."""
    if not _MID_MODEL:
        directory = tmp_path_factory.mktemp("mid")
        config = AutoConfig.for_model(
            "llama", hidden_size=768, intermediate_size=3072, num_hidden_layers=24, num_attention_heads=12,
            num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False,
        )  # fmt: skip
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
        model.save_pretrained(directory)
        _MID_MODEL.append(directory)
    return _MID_MODEL[0]


# ---------------------------------------------------------------------------------------------- the server


def test_the_server_reports_the_quantization_and_weight_bytes(model_dir: Callable[[str], Path]) -> None:
    """/v1/models and /metrics say how the model is stored, and a quantized model answers through the SDK."""
    path = model_dir("llama")
    plain = weight_bytes(load_model(EngineConfig.of(model=str(path))).model)
    with running_server(path, "--quantization", "int8", "--served-model-name", "tiny", "--num-pages", "64") as url:
        with httpx.Client(base_url=url, timeout=30) as http:
            card = http.get("/v1/models").json()["data"][0]
            assert card["quantization"] == "int8"
            assert 0 < card["weight_bytes"] < plain
            assert card["kv_cache_dtype"] == "float32"
            samples = metric_samples(http)
            assert metric(samples, "ferry:model_weight_bytes", model_name="tiny") == card["weight_bytes"]
            assert metric(samples, "ferry:model_info", quantization="int8", kv_cache_dtype="float32") == 1
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            reply = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
            assert reply.usage.completion_tokens >= 1
