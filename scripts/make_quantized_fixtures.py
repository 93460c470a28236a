"""Make the quantized-checkpoint test fixtures (tests/fixtures/quantized/) with the tools users' checkpoints come
from: llm-compressor (compressed-tensors) and GPTQModel (GPTQ, and AWQ in AutoAWQ's GEMM layout), from tiny random
Llama and Qwen2 models of the native families.

Neither tool installs beside the project's pins (each pins its own torch and transformers ranges; AutoAWQ and
AutoGPTQ are unmaintained), so each runs from a venv of its own and the directories they write are committed
(about 4 MB in all). Run once per tool, from the repository root:

    python -m venv /tmp/venv-llmc && /tmp/venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /tmp/venv-llmc/bin/python scripts/make_quantized_fixtures.py llmcompressor

    python -m venv /tmp/venv-gptq && /tmp/venv-gptq/bin/pip install torch==2.13.0 gptqmodel==7.3.6 requests \
        torchvision
    /tmp/venv-gptq/bin/python scripts/make_quantized_fixtures.py gptqmodel

(the second venv ended on torch 2.14.1, which torchvision pulled in: GPTQModel 7.3.6 took it). The models are 128
wide with a 256-wide MLP, so every layer's inputs divide into the tools' default groups of 128; the Llama has fewer
KV heads than query heads, the Qwen2 biases on q, k and v.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.model_factory import _training_text, build_model_dir

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "quantized"

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
BASES = {"llama": dict(SHAPE, num_key_value_heads=2), "qwen2": dict(SHAPE, num_key_value_heads=2)}

LLM_COMPRESSOR = [
    # (directory, base, llm-compressor preset scheme)
    ("ct-w8a8-llama", "llama", "W8A8"),
    ("ct-w8a16-llama", "llama", "W8A16"),
    ("ct-w4a16-llama", "llama", "W4A16"),
    ("ct-w4a16-asym-qwen2", "qwen2", "W4A16_ASYM"),
    ("ct-fp8-llama", "llama", "FP8"),
    ("ct-fp8-dynamic-llama", "llama", "FP8_DYNAMIC"),
]

GPTQMODEL = [
    # (directory, base, QuantizeConfig arguments)
    ("gptq-int4-llama", "llama", dict(bits=4, group_size=128, sym=True, desc_act=False)),
    ("gptq-int4-asym-actorder-qwen2", "qwen2", dict(bits=4, group_size=64, sym=False, desc_act=True)),
    ("gptq-int4-channel-llama", "llama", dict(bits=4, group_size=-1, sym=True, desc_act=False, act_group_aware=False)),
    ("gptq-int8-llama", "llama", dict(bits=8, group_size=128, sym=True, desc_act=False)),
    ("awq-int4-llama", "llama", dict(bits=4, group_size=64, sym=False, method="awq", format="gemm")),
]


def _base(tmp: Path, arch: str) -> Path:
    """The tiny random model in bfloat16, as checkpoints are published."""
    directory = build_model_dir(tmp / f"{arch}-float32", arch, seed=7, **BASES[arch])
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    out = tmp / arch
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(directory).save_pretrained(out)
    return out


def _calibration(tokenizer_dir: Path) -> list[str]:
    text = _training_text()
    return [" ".join(text[i : i + 8]) for i in range(0, min(len(text), 256), 8)]


def _replace(target: Path, made: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(made, target)
    print(f"wrote {target}")


def _save_dequantized(made: Path, scratch: Path, awq: bool) -> None:
    """The tool's own dequantization of the quantized linears, in float32 (a 4-bit code times a float16 scale is
    exact there), beside the checkpoint as `NAME.dequantized.safetensors` (outside its directory, which holds the
    checkpoint alone): the tests' reference weights for formats that transformers loads only through GPTQModel.
    GPTQ: GPTQModel's `dequantize_model`. AWQ: `dequantize_gemm`, the function GPTQModel's AWQ kernels are checked
    against (`dequantize_model` 7.3.6 reads AWQ's words without their interleaved order)."""
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.utils.model_dequant import dequantize_model
    from safetensors import safe_open
    from safetensors.torch import save_file

    linears = {}
    if awq:
        group_size = json.loads((made / "config.json").read_text())["quantization_config"]["group_size"]
        with safe_open(str(made / "model.safetensors"), framework="pt") as f:
            for key in f:
                if key.endswith(".qweight"):
                    prefix = key.removesuffix(".qweight")
                    qweight, qzeros, scales = (f.get_tensor(f"{prefix}.{n}") for n in ("qweight", "qzeros", "scales"))
                    weight = dequantize_gemm(qweight, qzeros, scales.float(), 4, group_size)  # [in, out]
                    linears[f"{prefix}.weight"] = weight.t().contiguous()
    else:
        dequantize_model(made, scratch, target_dtype=torch.float32)
        for path in scratch.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                linears.update({k: f.get_tensor(k).contiguous() for k in f if "_proj.weight" in k})
    save_file(linears, str(made.parent / f"{made.name}.dequantized.safetensors"))


def llmcompressor() -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        bases = {arch: _base(tmp, arch) for arch in BASES}
        for name, arch, scheme in LLM_COMPRESSOR:
            if not (OUT / name).exists():
                tokenizer = AutoTokenizer.from_pretrained(bases[arch])
                model = AutoModelForCausalLM.from_pretrained(bases[arch], dtype=torch.bfloat16)
                texts = _calibration(tmp)
                calibration = Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})
                oneshot(
                    model=model,
                    dataset=calibration,
                    recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]),
                    max_seq_length=64,
                    num_calibration_samples=len(calibration),
                )
                made = tmp / name
                model.save_pretrained(made, save_compressed=True)
                tokenizer.save_pretrained(made)
                _replace(OUT / name, made)
            if not (OUT / f"{name}.dequantized.safetensors").exists():
                _save_decompressed(OUT / name)


def _save_decompressed(made: Path) -> None:
    """compressed-tensors' own decompression of each quantized linear (the checkpoint as transformers loads it, then
    `decompress_module`), in float32, as `NAME.dequantized.safetensors` beside the checkpoint: the tests' reference
    weights, also for the asymmetric checkpoint that transformers 5.24 with compressed-tensors 0.20 fails to load
    (it expects the zero points unpacked)."""
    from compressed_tensors.compressors.base import decompress_module
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32)
    linears = {}
    for name, module in model.named_modules():
        if name.endswith("_proj") and hasattr(module, "weight_scale"):
            decompress_module(module)
            linears[f"{name}.weight"] = module.weight.detach().float().contiguous()
    save_file(linears, str(made.parent / f"{made.name}.dequantized.safetensors"))


def gptqmodel() -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.models._const import DEVICE
    from gptqmodel.nn_modules.qlinear.gemm_awq import AwqGEMMLinear

    # AWQ's GEMM layout is packed by AwqGEMMLinear.pack, plain torch; the class lists only GPU devices and asks for
    # its CUDA extension because its matmul is a CUDA kernel, which making the checkpoint never calls.
    AwqGEMMLinear.SUPPORTS_DEVICES = [*AwqGEMMLinear.SUPPORTS_DEVICES, DEVICE.CPU]
    AwqGEMMLinear.validate_once = classmethod(lambda cls: (True, None))

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        bases = {arch: _base(tmp, arch) for arch in BASES}
        for name, arch, arguments in GPTQMODEL:
            awq = arguments.get("method") == "awq"
            if not (OUT / name).exists():
                tokenizer = AutoTokenizer.from_pretrained(bases[arch])
                model = GPTQModel.load(str(bases[arch]), QuantizeConfig(**arguments), device="cpu")
                model.quantize(_calibration(tmp), tokenizer=tokenizer, batch_size=1)
                made = tmp / name
                model.save(str(made))
                tokenizer.save_pretrained(made)
                (made / "quant_log.csv").unlink(missing_ok=True)  # timings of this run
                _replace(OUT / name, made)
            if not (OUT / f"{name}.dequantized.safetensors").exists():
                _save_dequantized(OUT / name, tmp / f"{name}-dequantized", awq)


if __name__ == "__main__":
    {"llmcompressor": llmcompressor, "gptqmodel": gptqmodel}[sys.argv[1]]()  # an existing fixture is kept
