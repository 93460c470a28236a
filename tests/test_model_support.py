"""Exact or refused: a model the engine cannot run exactly is refused when it loads, with an error naming its model
type and the feature, and a model the native modules cannot run exactly goes to the transformers adapter.

Config-level refusals need no weights; the rest are found by the adapter's load-time probe, whose checks are also
driven here through subclasses that break one thing each (positions, logit post-processing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine import EngineConfig, EngineCore, SamplingParams, UnsupportedModelError, generate_batch
from engine.models.hf_adapter import ATTN_IMPLEMENTATION, TransformersCausalLM
from engine.models.loader import load_model
from engine.models.registry import choose_model_class
from engine.models.transformers_loading import paged_transformers_model
from tests.model_factory import ARCHITECTURES, build_model_dir


def _refusal(path: Path, **config) -> UnsupportedModelError:
    with pytest.raises(UnsupportedModelError) as info:
        load_model(EngineConfig.of(model=str(path), num_pages=16, **config))
    return info.value


@pytest.mark.parametrize(
    ("arch", "overrides", "feature"),
    [
        ("falcon", {"alibi": True}, "ALiBi as Falcon computes it"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("gpt_neo", {}, "attention classes from a table of the model's own with no paged entry"),
        ("mpt", {}, "code that does not run on paged attention"),
    ],
)
def test_features_the_engine_lacks_are_refused_at_load(
    tmp_path: Path, arch: str, overrides: dict, feature: str
) -> None:
    error = _refusal(build_model_dir(tmp_path, arch, **overrides))
    model_type = ARCHITECTURES[arch]["model_type"]
    assert (error.model_type, feature in error.feature) == (model_type, True)
    assert str(error).startswith(f"model_type {model_type!r}: ") and feature in str(error)


@pytest.mark.parametrize(
    ("model_type", "feature"),
    [
        ("bart", "an encoder-decoder architecture"),
        ("t5", "no causal language-model class"),
        ("paligemma", "images through paligemma"),
    ],
)
def test_config_refusals_come_before_any_weights(tmp_path: Path, model_type: str, feature: str) -> None:
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)  # a config alone: nothing else is read
    error = _refusal(tmp_path)
    assert error.model_type == model_type and error.feature.startswith(feature)


def test_native_is_refused_for_a_model_type_it_lacks(model_dir: Callable[[str], Path]) -> None:
    error = _refusal(model_dir("gemma2"), model_impl="native")
    assert error.model_type == "gemma2" and error.feature.startswith("--model-impl native")


def test_a_feature_the_native_modules_lack_sends_auto_to_the_adapter(tmp_path: Path) -> None:
    """A Llama with a GELU MLP: `native` refuses it, `auto` runs it exactly through the transformers adapter."""
    path = build_model_dir(tmp_path, "llama", hidden_act="gelu")
    assert _refusal(path, model_impl="native").feature.startswith("hidden_act='gelu'")
    engine = EngineCore(EngineConfig.of(model=str(path), num_pages=64, debug_checks=True))
    assert isinstance(engine.runner.model, TransformersCausalLM)
    prompts = [[10, 20, 30, 40, 50], [60, 70, 80]]
    results = generate_batch(prompts, params=SamplingParams(max_new_tokens=8), engine=engine)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, prompt in enumerate(prompts):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        assert results[f"req_{i}"].generated_ids == want


def _adapter(path: Path, cls: type[TransformersCausalLM] = TransformersCausalLM) -> TransformersCausalLM:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION)
    return cls(hf.eval())


def test_attention_computed_outside_the_interface_is_refused(model_dir: Callable[[str], Path]) -> None:
    """Bloom computes attention in its own modules; without the paged modules the loader swaps in, no layer would
    reach the paged backend (each prompt would attend over the whole packed row)."""
    with pytest.raises(UnsupportedModelError, match="attention computed outside transformers' attention interface"):
        _adapter(model_dir("bloom")).check_runs_exactly()


class _RowPositions(TransformersCausalLM):
    """Hands the model row indices for positions, as a model that ignores `position_ids` would see them."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        return super().forward(input_ids, torch.arange(len(positions), device=positions.device), kv_caches)


@pytest.mark.parametrize(
    ("arch", "symptom"),
    [
        # Learned absolute positions: a prompt packed after another one sits at the wrong positions.
        ("gpt2", "change when another sequence shares the batch"),
        # Rotary positions are relative within a prompt; a token over cached keys is what goes wrong.
        ("llama", "change when earlier tokens come from the KV cache"),
    ],
)
def test_outputs_that_depend_on_the_row_are_refused(model_dir: Callable[[str], Path], arch: str, symptom: str) -> None:
    _adapter(model_dir(arch)).check_runs_exactly()  # the probe passes the real thing
    with pytest.raises(UnsupportedModelError, match=symptom):
        _adapter(model_dir(arch), _RowPositions).check_runs_exactly()


class _HeadOnly(TransformersCausalLM):
    """Logits straight from the output projection, without the post-processing the model applies after it."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_output_embeddings()(hidden).float()


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_logits_post_processed_unlike_compute_logits_are_refused(model_dir: Callable[[str], Path], arch: str) -> None:
    """Gemma2 soft-caps its logits, Cohere multiplies and Granite divides them after the head."""
    _adapter(model_dir(arch)).check_runs_exactly()
    with pytest.raises(UnsupportedModelError, match="logits post-processed after the output projection"):
        _adapter(model_dir(arch), _HeadOnly).check_runs_exactly()


TRANSFORMERS_CANNOT_BUILD_ITS_DEFAULT = {
    "cohere_compass_text",
    "dbrx",
    "dots1",
    "gemma4_assistant",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "lfm2_moe",
    "ministral",
    "nemotron",
    "qwen4_exp_text",
    "reformer",
}
"""Model types whose default config transformers itself cannot make a causal LM of (None sizes, missing fields, a
validator's refusal): a checkpoint of theirs brings a config that can, so these are not start-up failures of Ferry's."""


def _default_causal_lm(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _start_up_on_meta(model_type: str) -> str:
    """What start-up decides for `model_type`'s default config, with no weights: 'native' or 'adapter' (its modules
    built on the meta device, paged attention and all; the adapter's load-time probe then runs the real model), or
    raises UnsupportedModelError."""
    config = AutoConfig.for_model(model_type)
    model_class = choose_model_class(config, "auto")
    if model_class is TransformersCausalLM:
        with torch.device("meta"):
            TransformersCausalLM(paged_transformers_model(config, AutoModelForCausalLM.from_config))
        return "adapter"
    model_class.empty(config, 64, torch.device("meta"), torch.float32)
    return "native"


def test_every_causal_lm_transformers_ships_is_claimed_or_refused_by_name() -> None:
    """Each `*ForCausalLM` model type at its default config, through the support check and its modules' construction
    on the meta device (no arithmetic, so the walk is quick): claimed (native modules, or the adapter) or refused
    with an UnsupportedModelError naming the type and the feature; never another exception."""
    verdicts: dict[str, str] = {}
    crashes = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in TRANSFORMERS_CANNOT_BUILD_ITS_DEFAULT:
            with pytest.raises(Exception):  # noqa: B017 - transformers' own, of whatever kind; gone: drop the name
                _default_causal_lm(model_type)
            continue
        try:
            verdicts[model_type] = _start_up_on_meta(model_type)
        except UnsupportedModelError as error:
            assert error.model_type == model_type and error.feature, error
            verdicts[model_type] = f"refused: {error.feature}"
        except Exception as error:
            crashes.append(f"{model_type}: {type(error).__name__}: {error}")
    assert not crashes, "start-up raised something other than a refusal:\n" + "\n".join(crashes)
    claimed = {model_type for model_type, verdict in verdicts.items() if not verdict.startswith("refused")}
    native = {model_type for model_type in claimed if verdicts[model_type] == "native"}
    families = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]
    assert {*families, "deepseek_v2", "deepseek_v3", "glm4_moe_lite"} <= native
    assert {"gpt2", "gemma2", "phi3"} <= claimed
    assert {"mamba", "falcon_mamba", "mamba2", "jamba", "bamba", "granitemoehybrid"} <= native
    for model_type in ("falcon_h1", "nemotron_h", "zamba", "zamba2", "qwen3_next", "rwkv"):
        assert verdicts[model_type].startswith("refused: recurrent layers (state-space, linear-attention or RNN)")
    assert verdicts["gpt_neo"] == "refused: attention classes from a table of the model's own with no paged entry"
    assert len(verdicts) + len(TRANSFORMERS_CANNOT_BUILD_ITS_DEFAULT) == len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
