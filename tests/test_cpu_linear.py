"""The oneDNN-packed linear method: same results as `nn.Linear`; and every linear of a CPU engine's model computes
from a packed layout (the blocked kernel's, or oneDNN's where the kernel cannot be had)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from engine import EngineConfig, EngineCore
from engine.layers.linear import LinearBase, adopt_linears
from engine.layers.linear_method import (
    BlockedLinearMethod,
    PackedLinearMethod,
    UnquantizedLinearMethod,
    onednn_linear_available,
)

pytestmark = pytest.mark.skipif(
    not onednn_linear_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_linear_does(dtype: torch.dtype, bias: bool) -> None:
    if not onednn_linear_available(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} linears on this CPU")
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 96, bias=bias), nn.SiLU(), nn.Linear(96, 32, bias=bias)).to(dtype)
    inputs = [torch.randn(rows, 64, dtype=dtype) for rows in (1, 7, 64, 300)] + [torch.randn(1, 5, 64, dtype=dtype)]
    with torch.inference_mode():
        expected = [block(x) for x in inputs]
        assert adopt_linears(block, PackedLinearMethod()) == 2
        assert all(isinstance(block[i].method, PackedLinearMethod) for i in (0, 2))
        assert not [name for name, _ in block.named_parameters() if name.endswith("weight")], "plain copies freed"
        got = [block(x) for x in inputs]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for want, out in zip(expected, got, strict=True):
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out, want, **tolerance)


def test_a_layer_onednn_cannot_pack_keeps_its_plain_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    block = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = block(x)
    calls: list[int] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def refuse_second(weight: torch.Tensor, rows: int) -> torch.Tensor:
        calls.append(rows)
        if len(calls) == 2:
            raise RuntimeError("unsupported")
        return reorder(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_second)
    assert adopt_linears(block, PackedLinearMethod()) == 2
    assert isinstance(block[0].method, PackedLinearMethod)
    assert isinstance(block[1].method, UnquantizedLinearMethod) and block[1].weight.shape == (8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_half_precision_and_cuda_are_left_to_torch() -> None:
    assert not onednn_linear_available(torch.device("cpu"), torch.float16)
    assert not onednn_linear_available(torch.device("cuda"), torch.float32)


def test_gpt2_conv1d_packs_with_its_transposed_weight() -> None:
    torch.manual_seed(0)
    layer = Conv1D(48, 32)  # nf (out) 48, nx (in) 32: weight stored [in, out]
    torch.nn.init.normal_(layer.bias)
    block = nn.Sequential(layer)
    x = torch.randn(2, 5, 32)
    with torch.inference_mode():
        want = block(x)
        assert adopt_linears(block, PackedLinearMethod()) == 1
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2"])
def test_cpu_engine_packs_every_linear_native_and_breadth_path(arch: str, model_dir: Callable[[str], Path]) -> None:
    engine = EngineCore(EngineConfig.of(model=str(model_dir(arch)), num_pages=64))
    modules = list(engine.runner.model.modules())
    assert not [m for m in modules if type(m) in (nn.Linear, Conv1D)]
    linears = [m for m in modules if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.method, BlockedLinearMethod | PackedLinearMethod) for m in linears)
