"""Quantized checkpoints as their tools write them (engine/quantization/checkpoints.py): compressed-tensors from
llm-compressor, GPTQ and AWQ from GPTQModel, made by scripts/make_quantized_fixtures.py and committed under
tests/fixtures/quantized/ with each tool's own dequantization of the linears beside them (`NAME.dequantized
.safetensors`).

The oracle: Ferry's dequantized weights against the tool's; its greedy tokens and logprobs against transformers'
forward over the tool's dequantized weights (weight-only formats), and against transformers loading the checkpoint
itself where it does (compressed-tensors: it quantizes the activations as the scheme says); tensor parallelism
against one rank; refusals by name; `ferry serve` on a GPTQ checkpoint through the OpenAI SDK, its card naming
the format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.config import EngineConfig, EngineStartupError
from engine.layers.linear import LinearBase
from engine.quantization import UnsupportedQuantization
from engine.quantization.awq import ORDER, unpack_outputs
from engine.quantization.checkpoints import checkpoint_quantization
from engine.quantization.grouped import GroupedIntMethod, unpack_words
from tests.server_harness import server_process

FIXTURES = Path(__file__).parent / "fixtures" / "quantized"
SERVED = {
    # fixture: (the kernel's scheme, the method that runs its linears)
    "ct-w8a8-llama": ("int8-dynamic", "CheckpointW8A8Method"),
    "ct-w8a16-llama": ("int8", "GroupedIntMethod"),
    "ct-w4a16-llama": ("int4", "GroupedIntMethod"),
    "ct-w4a16-asym-qwen2": ("int4", "GroupedIntMethod"),
    "ct-fp8-llama": ("fp8", "CheckpointFp8Method"),
    "ct-fp8-dynamic-llama": ("fp8", "CheckpointFp8Method"),
    "gptq-int4-llama": ("int4", "GroupedIntMethod"),
    "gptq-int4-asym-actorder-qwen2": ("int4", "GroupedIntMethod"),
    "gptq-int4-channel-llama": ("int4", "GroupedIntMethod"),
    "gptq-int8-llama": ("int8", "GroupedIntMethod"),
    "awq-int4-llama": ("int4", "GroupedIntMethod"),
}
ASYMMETRIC = {"ct-w4a16-asym-qwen2", "gptq-int4-asym-actorder-qwen2", "awq-int4-llama"}
"""Minimums (-scale * zero) that float16 may not hold: rounded (engine/quantization/grouped.py)."""
WEIGHT_ONLY = [name for name, (scheme, _) in SERVED.items() if scheme in ("int4", "int8")]
ACTIVATIONS_QUANTIZED = [name for name in SERVED if name not in WEIGHT_ONLY]
PROMPTS = [[1, 45, 74, 81, 365, 308], [1, 20, 30, 40], [1, 7, 200, 100, 50, 25, 12, 300]]
LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj",
           "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip


def _engine_config(model: str | Path, **overrides: object) -> EngineConfig:
    """A fixture by name, or a model directory."""
    model_dir = model if isinstance(model, Path) else FIXTURES / model
    return EngineConfig.of(model=str(model_dir), dtype="float32", num_pages=64, cpu_threads=1, **overrides)


def _ferry(model: str | Path, max_new_tokens: int = 6, **overrides: object) -> list[tuple[list[int], list[float]]]:
    from engine.api import generate_batch
    from engine.core.engine_core import EngineCore
    from engine.core.request import SamplingParams

    engine = EngineCore(_engine_config(model, **overrides))
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, logprobs=True)
        results = generate_batch(PROMPTS, params=params, engine=engine)
    finally:
        engine.close()
    outputs = [results[f"req_{i}"] for i in range(len(PROMPTS))]
    return [(list(out.generated_ids), [entry.logprob for entry in out.logprobs or []]) for out in outputs]


def _dequantized(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / f"{name}.dequantized.safetensors")


def _reference_model(name: str) -> torch.nn.Module:
    """transformers' model of the fixture, in float32, with the tool's dequantized linears."""
    config = AutoConfig.from_pretrained(FIXTURES / name)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stored = load_file(FIXTURES / name / "model.safetensors")
    state = {key: value.float() for key, value in stored.items() if key in model.state_dict()}
    state.update(_dequantized(name))
    incompatible = model.load_state_dict(state, strict=False)
    assert not incompatible.missing_keys or incompatible.missing_keys == ["lm_head.weight"]  # tied: the embedding's
    return model.eval()


def _assert_matches(reference: torch.nn.Module, outputs: list[tuple[list[int], list[float]]], atol: float) -> None:
    for prompt, (tokens, logprobs) in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        assert tokens == expected.argmax(-1).tolist()
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), chosen, atol=atol, rtol=0)


def test_fixtures_are_there() -> None:
    made = sorted(path.name for path in FIXTURES.iterdir() if path.is_dir())
    assert made == sorted(SERVED)
    assert all((FIXTURES / f"{name}.dequantized.safetensors").is_file() for name in made)


@given(st.lists(st.integers(0, 15), min_size=8, max_size=64).filter(lambda codes: len(codes) % 8 == 0))
def test_words_unpack_to_their_codes_lowest_bits_first(codes: list[int]) -> None:
    words = [sum(code << (4 * i) for i, code in enumerate(codes[j : j + 8])) for j in range(0, len(codes), 8)]
    signed = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)
    assert unpack_words(signed, 4, 1)[0].tolist() == codes
    assert unpack_words(signed.t(), 4, 0)[:, 0].tolist() == codes


def test_awq_words_hold_their_outputs_interleaved() -> None:
    """AutoAWQ's packer puts output 8j + ORDER[n] in a word's n-th 4 bits."""
    outputs = torch.arange(16) % 16
    word = [sum(int(outputs[8 * j + ORDER[n]]) << (4 * n) for n in range(8)) for j in range(2)]
    packed = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in word]], dtype=torch.int32)
    assert unpack_outputs(packed)[0].tolist() == outputs.tolist()


@pytest.mark.parametrize("name", sorted(SERVED))
def test_linears_dequantize_to_the_tools_weights(name: str) -> None:
    """Codes and scales are kept exactly (float16 holds these checkpoints' scales); an asymmetric group's minimum,
    -scale * zero, is rounded to float16: within 2^-11 of 15 scales, 2^-10 of its row's largest |weight| (which
    spans at least 7.5 scales)."""
    from engine.models.loader import load_model

    _, method = SERVED[name]
    model = load_model(_engine_config(name)).model
    reference = _dequantized(name)
    layer = model.model.layers[0]
    for fused, parts in LINEARS.items():
        linear = getattr(layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp, fused)
        assert type(linear.method).__name__ == method
        expected = torch.cat([reference[f"model.layers.0.{_module(part)}.{part}.weight"] for part in parts])
        ours = linear.method.dequantized_weight(linear)
        if name in ASYMMETRIC:
            assert ((ours - expected).abs() <= 2**-10 * expected.abs().amax(1, keepdim=True)).all(), fused
        else:
            assert torch.equal(ours, expected), fused


def _module(part: str) -> str:
    return "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_logprobs_match_a_forward_over_the_tools_dequantized_weights(name: str) -> None:
    """The same weights, summed in another order; an asymmetric group's minimum rounded to float16 moves a logprob of
    these sharp random models by up to 0.004."""
    _assert_matches(_reference_model(name), _ferry(name), atol=0.01 if name in ASYMMETRIC else 2e-4)


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """W8A8's activations as the kernel (and vLLM) quantize them: symmetric per token, scale max |x| / 127."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def _per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _static_fp8(scale: torch.Tensor):
    return lambda x: (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _quantizing_reference(name: str) -> torch.nn.Module:
    """The forward over the tool's dequantized weights with each linear's input quantized as the scheme says
    (forward pre-hooks): per token at each step, or (static fp8) by the largest of the fused parts' scales."""
    model = _reference_model(name)
    stored = load_file(FIXTURES / name / "model.safetensors")
    for module_name, module in model.named_modules():
        if not module_name.endswith("_proj") or module_name.endswith("lm_head"):
            continue
        if name == "ct-w8a8-llama":
            quantize = _per_token_int8
        elif name == "ct-fp8-dynamic-llama":
            quantize = _per_token_fp8
        else:
            fused = ("q_proj", "k_proj", "v_proj") if "self_attn" in module_name and "o_proj" not in module_name else ()
            fused = fused or (("gate_proj", "up_proj") if module_name.endswith(("gate_proj", "up_proj")) else ())
            parts = [module_name.rsplit(".", 1)[0] + "." + part for part in fused] or [module_name]
            quantize = _static_fp8(torch.stack([stored[f"{part}.input_scale"].float() for part in parts]).amax())
        module.register_forward_pre_hook(lambda _, args, quantize=quantize: (quantize(args[0]),))
    return model


@pytest.mark.parametrize("name", ACTIVATIONS_QUANTIZED)
def test_quantized_activations_match_a_forward_that_quantizes_them(name: str) -> None:
    """A quantized activation whose float32 value lies within rounding of a step between codes may take the other
    code in one forward than in the other (the sums come in another order), and every later position reads it
    through attention: on these sharp random models that moves a logprob by up to 0.3. Such a flip is rare: two
    of the three sequences agree to 1e-3 at every position."""
    reference = _quantizing_reference(name)
    agreeing = 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, _ferry(name), strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        difference = (torch.tensor(logprobs) - chosen).abs()
        assert (difference <= 0.3).all()
        agreeing += int((difference <= 1e-3).all())
        best, second = expected.topk(2, dim=-1).values.unbind(-1)
        clear = (best - second) > 0.3
        assert torch.equal(torch.tensor(tokens)[clear], expected.argmax(-1)[clear])
    assert agreeing >= 2


def test_fp8_matches_transformers_loading_the_checkpoint() -> None:
    """transformers with compressed-tensors quantizes FP8_DYNAMIC's activations as Ferry does. (Its int8 ones it
    scales by max |x| / 127.5 into -128..127, where Ferry's kernel, as vLLM's, takes max |x| / 127.)"""
    name = "ct-fp8-dynamic-llama"
    transformers_model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            transformers_model(ids).logits, _quantizing_reference(name)(ids).logits, atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("name", ["awq-int4-llama", "gptq-int4-channel-llama", "ct-fp8-llama"])
def test_two_ranks_compute_what_one_does(name: str) -> None:
    """Each rank keeps its slice of codes, scales and zero points; the groups of a row-parallel layer split
    between ranks whole (a scale per row stays whole on each). (W8A8 is left out: each rank quantizes its own
    columns of a row-parallel layer's input, by their own largest value, as vLLM's ranks do.)"""
    one, two = _ferry(name), _ferry(name, tensor_parallel_size=2)
    assert [tokens for tokens, _ in one] == [tokens for tokens, _ in two]
    for (_, a), (_, b) in zip(one, two, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def test_a_group_that_two_ranks_would_split_is_refused_by_layer() -> None:
    with pytest.raises(UnsupportedQuantization, match=r"o_proj \(64 -> 128 here\).*groups of 128"):
        _ferry("gptq-int4-llama", tensor_parallel_size=2)


def test_activation_order_gathers_the_inputs_of_each_group() -> None:
    from engine.models.loader import load_model

    model = load_model(_engine_config("gptq-int4-asym-actorder-qwen2")).model
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and isinstance(m.method, GroupedIntMethod)]
    assert all(linear.input_order is not None for linear in linears)  # activation order scrambled every layer


def test_refusals_name_the_format_and_what_it_lacks() -> None:
    with pytest.raises(UnsupportedQuantization, match=r"bitsandbytes.*not this format"):
        checkpoint_quantization({"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(UnsupportedQuantization, match=r"activation order \(desc_act\) over --tensor-parallel-size 2"):
        checkpoint_quantization({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, 2)
    with pytest.raises(UnsupportedQuantization, match="3-bit weights"):
        checkpoint_quantization({"quant_method": "gptq", "bits": 3, "group_size": 128})
    with pytest.raises(UnsupportedQuantization, match="'gemv' layout"):
        checkpoint_quantization({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    ct = json.loads((FIXTURES / "ct-w8a8-llama" / "config.json").read_text())["quantization_config"]
    with pytest.raises(UnsupportedQuantization, match="a quantized lm_head"):
        checkpoint_quantization({**ct, "ignore": []})
    with pytest.raises(UnsupportedQuantization, match="a quantized KV cache"):
        checkpoint_quantization({**ct, "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    group = ct["config_groups"]["group_0"]
    by_group = {**group, "weights": {**group["weights"], "strategy": "group", "group_size": 128}}
    with pytest.raises(UnsupportedQuantization, match="int8 weights by 'group' with quantized activations"):
        checkpoint_quantization({**ct, "config_groups": {"group_0": by_group}})


def test_a_quantized_checkpoint_takes_no_quantization_flag() -> None:
    from engine.models.loader import load_model

    with pytest.raises(UnsupportedQuantization, match=r"quantized already .*leave --quantization out"):
        load_model(_engine_config("gptq-int4-llama", quantization="int8"))


def test_the_transformers_adapter_refuses_a_quantized_checkpoint() -> None:
    from engine.models.loader import load_model
    from engine.models.support import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="a quantized checkpoint on the transformers adapter"):
        load_model(_engine_config("gptq-int4-llama", model_impl="transformers"))


@pytest.mark.parametrize("name", ["gptq-int4-asym-actorder-qwen2", "ct-fp8-llama"])
def test_dummy_weights_fill_a_quantized_checkpoints_layers(name: str, tmp_path: Path) -> None:
    """`--load-format dummy` over a quantized checkpoint's config (a benchmark of its shape): codes and scales."""
    shutil.copytree(FIXTURES / name, tmp_path / name, ignore=shutil.ignore_patterns("*.safetensors"))
    outputs = _ferry(tmp_path / name, max_new_tokens=4, load_format="dummy")
    assert all(len(tokens) == 4 for tokens, _ in outputs)


def test_ferry_serve_takes_a_gptq_checkpoint_and_names_its_format() -> None:
    name = "gptq-int4-llama"
    with server_process(FIXTURES / name, "--dtype", "float32") as s:
        card = httpx.get(f"{s.base_url}/v1/models").json()["data"][0]
        assert card["quantization"] == "int4"
        assert card["checkpoint_quantization"] == {
            "format": "gptq",
            "weights": "int4 weights, symmetric, groups of 128",
        }
        metrics = httpx.get(f"{s.base_url}/metrics").text
        assert 'quantization="int4"' in metrics
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=1, extra_body={"min_tokens": 5}
        )
    tokens, logprobs = _ferry(name, max_new_tokens=5)[0]
    assert completion.choices[0].text == AutoTokenizer.from_pretrained(FIXTURES / name).decode(tokens)
    served = completion.choices[0].logprobs
    assert served is not None and served.token_logprobs is not None
    torch.testing.assert_close(torch.tensor(served.token_logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_engine_startup_errors_are_engine_startup_errors() -> None:
    assert issubclass(UnsupportedQuantization, EngineStartupError)


@given(st.lists(st.integers(0, 15), min_size=8, max_size=8), st.sampled_from([4, 8]))
def test_v1_zero_points_come_back_with_their_borrows(zeros: list[int], bits: int) -> None:
    """GPTQ's v1 writers subtract 0x11111111 (0x01010101) from each whole word: a zero point of 0 borrows from the
    next one, which adding the constant back to the word undoes."""
    from engine.quantization.gptq import add_one_to_each_code

    codes = [z % (1 << bits) for z in zeros[: 32 // bits]]
    word = sum(code << (bits * i) for i, code in enumerate(codes))
    ones = sum(1 << shift for shift in range(0, 32, bits))
    stored = (word - ones) % (1 << 32)
    signed = torch.tensor([[stored - (1 << 32) if stored >= 1 << 31 else stored]], dtype=torch.int32)
    restored = add_one_to_each_code(signed, bits)
    assert unpack_words(restored, bits, 1)[0].tolist() == codes


def test_an_older_gptq_checkpoint_keeps_its_settings_beside_the_config(tmp_path: Path) -> None:
    """AutoGPTQ's checkpoints before transformers' integration: quantize_config.json, no quantization_config."""
    model_dir = tmp_path / "gptq-int4-llama"
    shutil.copytree(FIXTURES / "gptq-int4-llama", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (model_dir / "config.json").write_text(json.dumps(config))
    assert _ferry(model_dir) == _ferry("gptq-int4-llama")
