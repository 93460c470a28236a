"""engine/layers/: each layer kind's sharded loading reassembles the checkpoint's matrix over its ranks, the
method chosen for a device, dtype and CPU, and the switch that forces the AVX2 paths."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.cpu_isa import amx_tiles, bf16_dot_products
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
)
from engine.layers.linear_method import (
    BlockedLinearMethod,
    PackedLinearMethod,
    UnquantizedLinearMethod,
    WidenedLinearMethod,
    bf16_matmul_native,
    blocked_linear_available,
    onednn_linear_available,
    select_linear_method,
)
from engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tests.server_harness import REPO_ROOT

PLAIN = UnquantizedLinearMethod()
RANKS = 2


def _ranks(build: type[LinearBase], *args: object, **kwargs: object) -> list[LinearBase]:
    return [build(*args, bias=True, method=PLAIN, shard=Shard(rank, RANKS), **kwargs) for rank in range(RANKS)]


def test_replicated_linear_holds_the_whole_matrix() -> None:
    weight, bias = torch.randn(6, 4), torch.randn(6)
    layer = ReplicatedLinear(4, 6, bias=True, method=PLAIN)
    layer.weight_loader("weight", weight)
    assert not layer.loaded
    layer.weight_loader("bias", bias)
    assert layer.loaded and torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)


def test_column_parallel_ranks_hold_the_output_rows_in_order() -> None:
    weight, bias = torch.randn(8, 4), torch.randn(8)
    layers = _ranks(ColumnParallelLinear, 4, 8)
    for layer in layers:
        layer.weight_loader("weight", weight)
        layer.weight_loader("bias", bias)
    assert torch.equal(torch.cat([layer.weight for layer in layers]), weight)
    assert torch.equal(torch.cat([layer.bias for layer in layers]), bias)


def test_row_parallel_ranks_hold_the_input_columns_and_the_bias_once() -> None:
    weight, bias = torch.randn(4, 8), torch.randn(4)
    layers = _ranks(RowParallelLinear, 8, 4)
    for layer in layers:
        layer.weight_loader("weight", weight)
        layer.weight_loader("bias", bias)
    assert torch.equal(torch.cat([layer.weight for layer in layers], dim=1), weight)
    assert torch.equal(layers[0].bias, bias) and not layers[1].bias.any()
    x = torch.randn(3, 8)
    summed = sum(layer(part) for layer, part in zip(layers, x.chunk(RANKS, dim=1), strict=True))
    torch.testing.assert_close(summed, x @ weight.t() + bias)


def test_merged_column_ranks_hold_their_part_of_each_matrix() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layers = _ranks(MergedColumnParallelLinear, 4, [6, 6])
    for layer in layers:
        for index, part in enumerate((gate, up)):
            layer.weight_loader("weight", part, index)
            layer.weight_loader("bias", part[:, 0], index)
    halves = [layer.weight.split(3) for layer in layers]
    assert torch.equal(torch.cat([h[0] for h in halves]), gate) and torch.equal(torch.cat([h[1] for h in halves]), up)
    assert torch.equal(torch.cat([layer.bias[:3] for layer in layers]), gate[:, 0])


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_qkv_ranks_hold_their_heads_and_replicate_too_few_kv_heads(kv_heads: int) -> None:
    head_dim, heads, hidden = 2, 4, 8
    q, k, v = (
        torch.randn(heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
    )
    layers = _ranks(QKVParallelLinear, hidden, head_dim, heads, kv_heads)
    for layer in layers:
        for shard_id, part in zip("qkv", (q, k, v), strict=True):
            layer.weight_loader("weight", part, shard_id)
            layer.weight_loader("bias", part[:, 0], shard_id)
        assert layer.loaded
    parts = [layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size]) for layer in layers]
    assert torch.equal(torch.cat([p[0] for p in parts]), q)
    if kv_heads >= RANKS:
        assert torch.equal(torch.cat([p[1] for p in parts]), k) and torch.equal(torch.cat([p[2] for p in parts]), v)
    else:  # each rank holds the one KV head its query heads read
        assert all(torch.equal(p[1], k) and torch.equal(p[2], v) for p in parts)


def test_vocab_parallel_embedding_and_head_pad_the_last_rank() -> None:
    table = torch.randn(7, 4)
    embeddings = [VocabParallelEmbedding(7, 4, shard=Shard(rank, RANKS)) for rank in range(RANKS)]
    heads = [ParallelLMHead(7, 4, method=PLAIN, shard=Shard(rank, RANKS)) for rank in range(RANKS)]
    for embedding, head in zip(embeddings, heads, strict=True):
        embedding.weight_loader("weight", table)
        head.weight_loader("weight", table)
    for parts in ([e.weight for e in embeddings], [h.weight for h in heads]):
        whole = torch.cat(parts)
        assert whole.shape == (8, 4) and torch.equal(whole[:7], table) and not whole[7].any()
    ids = torch.tensor([0, 3, 4, 6])
    assert torch.equal(sum(e(ids) for e in embeddings), table[ids])  # each token's one real row, summed


def test_a_tied_head_on_a_method_that_cannot_give_rows_back_leaves_the_embedding_its_matrix() -> None:
    """oneDNN's packed layout is opaque: the head packs its copy, the embedding keeps looking rows up in the plain
    one (where the head's method could give rows back, the embedding reads through the head instead)."""
    if not onednn_linear_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN")
    embedding = VocabParallelEmbedding(7, 4)
    head = ParallelLMHead(7, 4, method=PackedLinearMethod(), tied=True)
    head.tie_to(embedding)
    matrix = torch.randn(7, 4)
    embedding.weight_loader("weight", matrix)
    assert hasattr(head, "packed_weight") and "weight" not in dict(head.named_parameters())
    torch.testing.assert_close(embedding(torch.tensor([3, 0, 6])), matrix[[3, 0, 6]], atol=0, rtol=0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(head(x), x @ matrix.t(), atol=1e-5, rtol=1e-5)


def test_packing_happens_when_the_last_shard_is_loaded() -> None:
    if not onednn_linear_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN")
    layer = MergedColumnParallelLinear(4, [6, 6], bias=False, method=PackedLinearMethod())
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layer.weight_loader("weight", gate, 0)
    assert "weight" in dict(layer.named_parameters())
    layer.weight_loader("weight", up, 1)
    assert "weight" not in dict(layer.named_parameters()) and hasattr(layer, "packed_weight")
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), x @ torch.cat([gate, up]).t(), atol=1e-5, rtol=1e-5)


def test_method_selection_by_device_dtype_and_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(select_linear_method(cuda, torch.bfloat16), UnquantizedLinearMethod)
    assert isinstance(select_linear_method(cpu, torch.float16), UnquantizedLinearMethod)
    kernel = blocked_linear_available(cpu, torch.float32)
    fp32_fallback = PackedLinearMethod if onednn_linear_available(cpu, torch.float32) else UnquantizedLinearMethod
    assert isinstance(select_linear_method(cpu, torch.float32), BlockedLinearMethod if kernel else fp32_fallback)
    tied = select_linear_method(cpu, torch.float32, embeds_rows=True)
    assert isinstance(tied, BlockedLinearMethod if kernel else UnquantizedLinearMethod) and tied.embeds_rows
    bf16 = select_linear_method(cpu, torch.bfloat16)
    bf16_tied = select_linear_method(cpu, torch.bfloat16, embeds_rows=True)
    assert bf16_tied.embeds_rows
    if bf16_matmul_native(cpu) and (amx_tiles() or not bf16_dot_products() or not kernel):
        # oneDNN multiplies bfloat16 faster than the kernel could; the tied head's rows need the blocked layout
        assert isinstance(bf16, PackedLinearMethod)
        assert isinstance(bf16_tied, BlockedLinearMethod if kernel else UnquantizedLinearMethod)
    elif bf16_matmul_native(cpu):  # AVX512-BF16 without AMX: the kernel's dot products stream decode faster
        assert isinstance(bf16, BlockedLinearMethod) and isinstance(bf16_tied, BlockedLinearMethod)
    else:
        assert isinstance(bf16, BlockedLinearMethod if kernel else WidenedLinearMethod)
        assert isinstance(bf16_tied, BlockedLinearMethod if kernel else WidenedLinearMethod)


_AVX2_PROBE = """
import torch
from engine.kernels.build import build_flags
from engine.layers.linear_method import BlockedLinearMethod, WidenedLinearMethod, bf16_matmul_native
from engine.layers.linear_method import select_linear_method
assert not bf16_matmul_native(torch.device("cpu"))
bf16 = select_linear_method(torch.device("cpu"), torch.bfloat16)
assert isinstance(bf16, BlockedLinearMethod | WidenedLinearMethod), bf16
assert "-mavx2" in build_flags() and not [f for f in build_flags() if f.startswith("-mavx512")], build_flags()
print("avx2 paths")
"""


def test_ferry_cpu_isa_avx2_selects_the_avx2_paths() -> None:
    """On any machine (an AVX512-BF16 one included), `FERRY_CPU_ISA=avx2` widens bfloat16 in the blocked kernel (or
    the widened method) instead of packing it for oneDNN, and builds the kernels with the AVX2 flags, under their own
    cache names."""
    env = {"FERRY_CPU_ISA": "avx2", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", _AVX2_PROBE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "avx2 paths" in result.stdout, result.stderr
    refused = subprocess.run(
        [sys.executable, "-c", "from engine.cpu_isa import forced_isa; forced_isa()"],
        cwd=REPO_ROOT, env={**env, "FERRY_CPU_ISA": "sse2"}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "FERRY_CPU_ISA='sse2'" in refused.stderr
