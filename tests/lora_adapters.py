"""LoRA adapters made with PEFT itself on the tiny models of tests/model_factory.py, saved as PEFT saves them.

`init_lora_weights=False` gives B random values too (PEFT's default starts B at zero, an adapter that changes
nothing); the values are then scaled up so that each adapter moves greedy tokens of these tiny models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

ADAPTER_SPECS: dict[str, dict] = {
    # Ranks 4-16, different modules, plain and rsLoRA scaling.
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=list(ATTENTION)),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=list(MLP)),
    "all-r16": dict(r=16, lora_alpha=32, target_modules=list(ATTENTION + MLP)),
    "qv-r16-rslora": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "ko-r6": dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj"]),
}


def build_adapter_dir(base_dir: Path, directory: Path, seed: int = 0, std: float = 0.3, **lora: object) -> Path:
    """Write a PEFT LoRA adapter of `base_dir`'s model (LoraConfig options `lora`) into `directory`."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **lora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(directory)
    return directory


def build_adapters(base_dir: Path, root: Path, names: Sequence[str] = tuple(ADAPTER_SPECS)) -> dict[str, Path]:
    """The adapters of ADAPTER_SPECS named `names`, each in `root / name`."""
    return {
        name: build_adapter_dir(base_dir, root / name, seed=i + 1, **ADAPTER_SPECS[name])
        for i, name in enumerate(names)
    }


def peft_model(base_dir: Path, adapter_dir: Path) -> PeftModel:
    """PEFT's own model of `base_dir` with the adapter in `adapter_dir`: the oracle."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
