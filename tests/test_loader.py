"""Loading weights: sharded checkpoints through their index, straight into the target dtype, and the memory it takes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.layers.linear_method import PackedLinearMethod, select_linear_method
from engine.models.checkpoint import SAFETENSORS_INDEX, checkpoint_files
from engine.models.loader import load_model
from tests.model_factory import build_model_dir
from tests.server_harness import REPO_ROOT


def _sharded_copy(source: Path, target: Path) -> Path:
    """`source` saved again as several shards with an index, as save_pretrained writes big checkpoints."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(target, max_shard_size="40KB")
    return target


def _greedy_logits(model_dir: Path, **config: str) -> torch.Tensor:
    from engine.api import generate_batch
    from engine.core.engine_core import EngineCore
    from engine.core.request import SamplingParams

    engine = EngineCore(EngineConfig.of(model=str(model_dir), num_pages=64, **config))
    results = generate_batch([[5, 6, 7, 8]], params=SamplingParams(max_new_tokens=6, logprobs=True), engine=engine)
    return torch.tensor([entry.logprob for entry in results["req_0"].logprobs])


def test_a_sharded_checkpoint_loads_exactly_the_files_its_index_lists(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = _sharded_copy(tiny_llama, tmp_path / "sharded")
    index = json.loads((sharded / SAFETENSORS_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "the checkpoint must really be sharded for this test to mean anything"
    # Beside the shards, a file the index does not list (Mistral repositories ship consolidated.safetensors):
    # loading it would fail, its tensor having no place in the model.
    save_file({"not.a.weight": torch.zeros(3)}, str(sharded / "consolidated.safetensors"))
    files = checkpoint_files(str(sharded))
    assert sorted(Path(path).name for path in files) == shards
    assert sorted(name for names in files.values() for name in names or ()) == sorted(index["weight_map"])
    assert torch.equal(_greedy_logits(sharded), _greedy_logits(tiny_llama))

    (sharded / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_model(EngineConfig.of(model=str(sharded)))


def test_weights_load_into_the_target_dtype(tiny_llama: Path) -> None:
    loaded = load_model(EngineConfig.of(model=str(tiny_llama), dtype="bfloat16", model_impl="native"))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert torch.equal(loaded.model.model.embed_tokens.weight, reference.model.embed_tokens.weight.to(torch.bfloat16))
    float32 = load_model(EngineConfig.of(model=str(tiny_llama), dtype="float32", model_impl="native"))
    assert loaded.model.cos_cache.dtype == torch.bfloat16
    assert torch.equal(loaded.model.cos_cache, float32.model.cos_cache.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("stored", "expected"),
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float32)],
)
def test_auto_dtype_on_cpu_keeps_a_bfloat16_checkpoint_and_widens_the_others(
    tiny_llama: Path, tmp_path: Path, stored: torch.dtype, expected: torch.dtype
) -> None:
    """A bfloat16 checkpoint runs in bfloat16 (half the bytes a token reads); float16 widens to float32 exactly."""
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=stored).save_pretrained(tmp_path)
    loaded = load_model(EngineConfig.of(model=str(tmp_path), device="cpu"))
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_model_keeps_one_embedding_matrix(tmp_path: Path, dtype: str) -> None:
    """Where the head's method gives rows back (the blocked kernel's layout, or the plain one) the matrix exists
    once in the model; a bfloat16 head where oneDNN multiplies bfloat16 faster (`select_linear_method`: with AMX)
    takes oneDNN's packed layout and the embedding keeps its own plain copy. Either way the embedding's rows are
    the checkpoint's and the head's logits transformers' own."""
    tied = build_model_dir(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model = load_model(EngineConfig.of(model=str(tied), dtype=dtype, model_impl="native")).model
    head, embedding = model.lm_head, model.model.embed_tokens
    onednn = isinstance(select_linear_method(torch.device("cpu"), getattr(torch, dtype)), PackedLinearMethod)
    assert isinstance(head.method, PackedLinearMethod) if onednn else head.method.embeds_rows
    tensors = [*model.state_dict(keep_vars=True).values()]
    tensors += [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    size = head.output_size * head.input_size
    # oneDNN's packed tensor is opaque (no storage to compare): counted apart.
    matrices = {t.untyped_storage().data_ptr() for t in tensors if not t.is_mkldnn and t.numel() >= size}
    assert len(matrices) == 1, "one plain (or blocked) copy of the tied matrix"
    assert not onednn or head.packed_weight.is_mkldnn, "and oneDNN's packed copy beside it for that head"
    reference = AutoModelForCausalLM.from_pretrained(tied, dtype=getattr(torch, dtype))
    ids = torch.arange(reference.config.vocab_size)
    assert torch.equal(embedding(ids), reference.model.embed_tokens(ids))
    hidden = torch.randn(5, reference.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(getattr(torch, dtype))
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(head(hidden), reference.lm_head(hidden), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_load_peaks_near_the_size_of_its_weights(tmp_path: Path, dtype: str) -> None:
    """A float32 checkpoint of ~180 MB loaded as `dtype`: the process grows by about the weights, not by a float32
    model first (bfloat16), nor by the unpacked and the packed model at once (float32, which oneDNN packs on every
    CPU; bfloat16 where it has bfloat16 arithmetic): packing goes layer by layer, so beside the weights only the
    layer being packed exists twice (gate/up, the largest, is 17% of this model). Measured in a fresh process, from
    anonymous memory (the checkpoint's page cache is not the loader's)."""
    model = build_model_dir(
        tmp_path / "mid", "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=8192,
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, "scripts/load_peak_memory.py", str(model), "--dtype", dtype],
        cwd=REPO_ROOT,
        # The script's own folder, not the checkout, heads its sys.path: without this, `import engine` could find
        # another checkout's installed copy and measure that one's loader.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(measured["loader"]).is_relative_to(REPO_ROOT), measured
    assert measured["weights_bytes"] > 80 * 2**20
    assert measured["peak_anon_bytes"] < 1.25 * measured["weights_bytes"], measured
