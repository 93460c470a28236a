"""The decoder stack as one C++ call (engine/models/llama_fused.py) computes what the eager modules compute, bit for
bit: the same tokens and the same logprobs, in float32 and bfloat16, for every Llama-family variant (biases, Qwen3's
per-head norms, sliding windows, mixed window groups), over prefill chunks longer than the SiLU kernel's limit and
batched decodes. bfloat16 runs on oneDNN where the CPU multiplies it and on the blocked kernel elsewhere: .ci/run
runs this file again with FERRY_CPU_ISA=avx2 for the second. Quantized linears too: every scheme the decoder calls a
kernel for, quantized at load (`--quantization`) or read from a checkpoint's codes (GPTQ, compressed-tensors W8A8,
GGUF). And it runs where it should, and only there (the transformers oracle of the fused path itself is
tests/test_engine_equivalence.py, which runs at the defaults; of the quantized checkpoints, tests/test_quantization.py
and tests/test_gguf.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine import EngineConfig, EngineCore, SamplingParams, generate_batch
from engine.kernels.library import cpu_kernels_available
from engine.models.gguf import materialize

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the CPU kernels cannot be built here")

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "qwen2_hybrid"]
FIXTURES = Path(__file__).parent / "fixtures"


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    lengths = [40, 3, 17, 29, 9, 64]  # prefill chunks above and below FUSED_SILU_MAX_TOKENS
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(max_new_tokens=12 + i, ignore_eos=True, logprobs=True, top_logprobs=2)
        for i in range(len(prompts))
    ]
    return prompts, params


def _run(path: Path, dtype: str, **overrides: object) -> tuple[dict, int]:
    """Every request's tokens and logprobs, and how many times the fused decoder ran."""
    config = EngineConfig.of(
        model=str(path), dtype=dtype, max_batch_tokens=48, max_num_seqs=4, cpu_threads=1, **overrides
    )
    engine = EngineCore(config)
    prompts, params = _workload(engine.runner.sampler.vocab_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = generate_batch(prompts, params=params, engine=engine)
    calls = sum(event.count for event in prof.key_averages() if event.key == "ferry_kernels::llama_decoder")
    return {rid: (out.generated_ids, out.logprobs) for rid, out in outputs.items()}, calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decoder_is_the_eager_path_bit_for_bit(model_dir: Callable[[str], Path], arch: str, dtype: str) -> None:
    fused, fused_calls = _run(model_dir(arch), dtype)
    eager, eager_calls = _run(model_dir(arch), dtype, enforce_eager=True)
    assert fused_calls > 0, "the fused decoder never ran"
    assert eager_calls == 0
    assert fused.keys() == eager.keys()
    for rid in fused:
        assert fused[rid] == eager[rid], rid


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "int4", "int8-dynamic"])
def test_quantized_linears_in_the_fused_decoder_are_the_eager_path_bit_for_bit(
    model_dir: Callable[[str], Path], quantization: str, dtype: str
) -> None:
    path = model_dir("qwen2")  # biases on q, k, v
    scheme = {"quantization": quantization, "quantization_group_size": 32}  # the tiny model's 64 inputs
    fused, fused_calls = _run(path, dtype, **scheme)
    eager, _ = _run(path, dtype, **scheme, enforce_eager=True)
    assert fused_calls > 0, "the fused decoder never ran"
    assert fused == eager


@pytest.mark.parametrize(
    "checkpoint",
    ["quantized/gptq-int4-llama", "quantized/gptq-int8-llama", "quantized/ct-w8a8-llama", "gguf/llama-q4_0.gguf"],
)
def test_checkpoint_codes_in_the_fused_decoder_are_the_eager_path_bit_for_bit(
    checkpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = FIXTURES / checkpoint
    if path.suffix == ".gguf":
        path = materialize(path, tmp_path_factory.mktemp("gguf-cache"))
    fused, fused_calls = _run(path, "float32")
    eager, _ = _run(path, "float32", enforce_eager=True)
    assert fused_calls > 0, "the fused decoder never ran"
    assert fused == eager


def test_gptq_act_order_keeps_the_modules() -> None:
    """Its x is gathered into group order before the kernel: no scheme of the decoder's computes that."""
    engine = EngineCore(EngineConfig.of(model=str(FIXTURES / "quantized/gptq-int4-asym-actorder-qwen2"), cpu_threads=1))
    assert engine.runner.model.model.fused is None


def test_steps_on_another_attention_backend_run_the_modules(tiny_llama: Path) -> None:
    outputs, calls = _run(tiny_llama, "float32", attention_backend="torch")
    reference, _ = _run(tiny_llama, "float32", enforce_eager=True)
    assert calls == 0
    assert [outputs[r][0] for r in sorted(outputs)] == [reference[r][0] for r in sorted(reference)]


def test_models_the_fused_decoder_cannot_serve_keep_the_modules(tiny_llama: Path) -> None:
    engine = EngineCore(EngineConfig.of(model=str(tiny_llama), dtype="float16", cpu_threads=1))
    assert engine.runner.model.model.fused is None, "float16 has no blocked kernel"
    engine = EngineCore(EngineConfig.of(model=str(tiny_llama), cpu_threads=1))
    assert engine.runner.model.model.fused is not None
    assert torch.get_default_dtype() == torch.float32
