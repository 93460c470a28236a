"""The model's per-layer cache specs are what the KV cache is built from, and its attention needs choose the backend.

Specs: each layer's K/V tensors are shaped and typed by its own spec (heads, head size, dtype may differ across
groups), a spec the engine cannot page is refused by name at start-up. Needs: each model says what its attention
asks for (windows, soft-capping, ALiBi, sinks), an explicit backend lacking one is refused at start-up and `auto`
passes over it. Sinks reach the backend the same eager and through the compiled path's op.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, EngineCore
from engine.attention import CpuPagedBackend, TorchPagedBackend, UnsupportedAttention
from engine.attention.base import AttentionFeature
from engine.attention.context import StepContext, step_context
from engine.attention.graph_op import paged_attention
from engine.attention.spec import (
    FullAttentionSpec,
    LatentAttentionSpec,
    NoCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from engine.config import EngineStartupError
from engine.execution.kv_caches import allocate_kv_caches, kv_cache_groups
from engine.models.loader import load_model
from tests.test_attention import DIM, HEADS, KV_HEADS, _Shapes, attention_runner, fresh_plan


class _Specs(torch.nn.Module):
    """A model that is only its layers' cache specs."""

    def __init__(self, specs: list) -> None:
        super().__init__()
        self.num_layers = len(specs)
        self._specs = specs

    def cache_specs(self) -> list:
        return self._specs


def test_each_layer_is_allocated_from_its_own_spec() -> None:
    specs = [
        FullAttentionSpec(4, 16, torch.bfloat16),
        SlidingWindowSpec(1, 8, torch.float32, 32),
        FullAttentionSpec(2, 8, torch.float16),
    ]
    layouts = kv_cache_groups(_Specs(specs), page_size=4)
    assert [(layout.window, layout.layers) for layout in layouts] == [(None, (0, 2)), (32, (1,))]
    group_of_layer = [0, 1, 0]
    caches = allocate_kv_caches(specs, group_of_layer, [10, 3], 4, 0, torch.device("cpu"))
    assert [(k.shape, k.dtype) for k, _ in caches] == [
        ((11, 4, 4, 16), torch.bfloat16),  # its pool's pages and the scratch page
        ((4, 4, 1, 8), torch.float32),
        ((11, 4, 2, 8), torch.float16),
    ]
    assert all(k.shape == v.shape and k.dtype == v.dtype for k, v in caches)
    # Zero until written (the CPU pages come from memory the system zeroes as it is first touched), each tensor
    # its own memory, writable.
    assert all(torch.count_nonzero(t) == 0 for pair in caches for t in pair)
    assert len({t.data_ptr() for pair in caches for t in pair}) == 2 * len(caches)
    assert all(t.data_ptr() % 64 == 0 for pair in caches for t in pair)  # as torch's allocator aligns
    caches[0][0][3].fill_(1.5)
    assert caches[0][0].sum().item() == 1.5 * 4 * 4 * 16 and caches[0][1].sum().item() == 0
    # A group's page is what its layers' tensors keep of a page's tokens.
    for g, layout in enumerate(layouts):
        held = sum(caches[layer][0][0].nbytes + caches[layer][1][0].nbytes for layer in layout.layers)
        assert layout.page_bytes == held, g


class _NoCacheSecondLayer(torch.nn.Module):
    """A real model whose second layer declares a cache kind the engine has no allocation for."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.num_layers = model.num_layers

    def cache_specs(self) -> list:
        specs = self.inner.cache_specs()
        return [specs[0], NoCacheSpec(), *specs[2:]]


def test_a_spec_the_engine_cannot_allocate_is_refused_at_start_up(model_dir: Callable[[str], Path]) -> None:
    config = EngineConfig.of(model=str(model_dir("llama")), num_pages=16)
    loaded = load_model(config)
    with pytest.raises(EngineStartupError, match="layer 1 keeps a NoCacheSpec cache, which Ferry cannot allocate"):
        EngineCore(config, loaded=dataclasses.replace(loaded, model=_NoCacheSecondLayer(loaded.model)))


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_a_recurrent_layer_keeps_state_slots_and_attention_layers_pages(
    model_dir: Callable[[str], Path], arch: str
) -> None:
    """Mamba pages nothing (one empty page group); Jamba's attention layers are paged and its Mamba layers hold
    (convolution, scan) states, one row per slot, one slot per sequence that may run."""
    engine = EngineCore(EngineConfig.of(model=str(model_dir(arch)), num_pages=16, page_size=4, max_num_seqs=5))
    specs = engine.runner.model.cache_specs()
    recurrent = [i for i, spec in enumerate(specs) if isinstance(spec, RecurrentStateSpec)]
    (layout,) = engine.kv_cache.layouts
    assert layout.layers == tuple(i for i in range(len(specs)) if i not in recurrent)
    assert (layout.page_bytes == 0) == (arch == "mamba")
    for i in recurrent:
        conv, scan = engine.runner.kv_caches[i]
        assert conv.shape == (5, *specs[i].conv_shape) and scan.shape == (5, *specs[i].ssm_shape)
        assert scan.dtype == torch.float32
    assert engine.kv_cache.states is not None and engine.kv_cache.states.num_slots == 5
    engine.close()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_latent_layer_caches_its_latent_and_rotary_key_only(
    model_dir: Callable[[str], Path], arch: str, kv_cache_dtype: str
) -> None:
    """MLA's point: a token costs `kv_lora_rank + qk_rope_head_dim` elements per layer, not K and V of every head,
    in the spec, in the page bytes the pools are sized by, and in the tensors (one, serving as K and V)."""
    hf = json.loads((model_dir(arch) / "config.json").read_text())
    width = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    expanded = hf["num_attention_heads"] * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"])
    element = 1 if kv_cache_dtype == "fp8" else 4
    engine = EngineCore(
        EngineConfig.of(model=str(model_dir(arch)), num_pages=16, page_size=4, kv_cache_dtype=kv_cache_dtype)
    )
    specs = engine.runner.model.cache_specs()
    assert all(isinstance(spec, LatentAttentionSpec) for spec in specs)
    assert [spec.bytes_per_token for spec in specs] == [width * 4] * hf["num_hidden_layers"]
    (layout,) = engine.kv_cache.layouts
    assert layout.page_bytes == 4 * hf["num_hidden_layers"] * width * element
    assert width < expanded
    for keys, values in engine.runner.kv_caches:
        assert keys is values and keys.shape == (17, 4, 1, width) and keys.element_size() == element
    engine.close()


# -- what the model needs of attention -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "features"),
    [
        ("llama", set()),
        ("mistral", {AttentionFeature.SLIDING_WINDOW}),
        ("gemma2", {AttentionFeature.SLIDING_WINDOW, AttentionFeature.SOFTCAP}),
        ("bloom", {AttentionFeature.ALIBI}),
        ("gpt_oss", {AttentionFeature.SLIDING_WINDOW, AttentionFeature.SINKS}),
        ("deepseek_v3", {AttentionFeature.LATENT}),
    ],
)
def test_each_model_declares_what_its_attention_needs(
    model_dir: Callable[[str], Path], arch: str, features: set[AttentionFeature]
) -> None:
    loaded = load_model(EngineConfig.of(model=str(model_dir(arch)), num_pages=16))
    assert loaded.model.attention_needs().features == features


def test_an_explicit_backend_lacking_a_need_is_refused_at_start_up(
    model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every CPU backend computes every feature: suppose the torch backend lacked sliding windows."""
    monkeypatch.setattr(TorchPagedBackend, "features", frozenset(AttentionFeature) - {AttentionFeature.SLIDING_WINDOW})
    with pytest.raises(UnsupportedAttention, match=r"attention_backend='torch' cannot compute sliding windows"):
        EngineCore(EngineConfig.of(model=str(model_dir("mistral")), num_pages=16, attention_backend="torch"))
    # A model that needs no window runs on it.
    EngineCore(EngineConfig.of(model=str(model_dir("llama")), num_pages=16, attention_backend="torch"))


def test_auto_passes_over_a_kernel_lacking_a_need(
    model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CpuPagedBackend, "features", frozenset(AttentionFeature) - {AttentionFeature.SINKS})
    assert load_model(EngineConfig.of(model=str(model_dir("gpt_oss")), num_pages=16)).backend.name == "torch"


# -- sinks through the compiled path's op -----------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_give_the_same_attention_eager_and_through_the_op(window: int | None) -> None:
    page_size = 4
    shapes = [(0, 9), (5, 1), (3, 6)]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    runner = attention_runner(_Shapes(), 8, page_size)
    inputs = runner.prepare(fresh_plan(shapes, tables))
    assert inputs is not None
    tokens = sum(n for _, n in shapes)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, DIM, generator=generator)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=generator) for _ in range(2))
    history = [torch.randn(runner.kv_caches[0][0].shape, generator=generator) for _ in range(2)]
    sinks = torch.tensor([2.0, -1.0, 0.5, 3.0])

    def layer(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], sinks: torch.Tensor
    ) -> torch.Tensor:
        return paged_attention(q, k, v, cache, DIM**-0.5, window, sinks)

    def run(fn: Callable[..., torch.Tensor], with_sinks: torch.Tensor | None) -> torch.Tensor:
        cache = (history[0].clone(), history[1].clone())
        context = StepContext(runner.backend, inputs.metas, [window], [cache])
        with step_context(context):
            return fn(q, k, v, cache, with_sinks)

    eager = run(layer, sinks)
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=False), sinks)
    torch.testing.assert_close(compiled, eager)
    assert not torch.allclose(eager, run(layer, None), atol=1e-3), "the sinks changed nothing"
