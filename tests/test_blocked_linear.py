"""The blocked linear kernel (engine/kernels/cpu_linear.cpp) against torch's own linear, its layout's row lookups,
the tied LM head that keeps one matrix in it, and the build every C++ kernel goes through (engine/kernels/build.py):
named by content, interruptible, processes taking turns."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_isa import bf16_dot_products
from engine.kernels.build import KernelUnavailable, build_flags, library_name, load_library
from engine.kernels.library import load_cpu_kernels, set_linear_helper
from engine.kernels.linear import embed_rows, pack
from engine.layers.linear import MergedColumnParallelLinear, Shard
from engine.layers.linear_method import BlockedLinearMethod
from engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding

try:
    load_cpu_kernels()
    UNAVAILABLE = ""
except KernelUnavailable as error:
    UNAVAILABLE = str(error)
needs_kernel = pytest.mark.skipif(bool(UNAVAILABLE), reason=f"the CPU kernels do not build here: {UNAVAILABLE}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (37, 19), (52, 64), (100, 256), (200, 256)])
def test_the_kernel_computes_what_linear_does(dtype: torch.dtype, out_features: int, in_features: int) -> None:
    """Every tile height (1 to 8 rows and their remainders), the chunk boundary (48 rows), a short last block (alone,
    and last of a few-row tile's several blocks: 52 outputs), several blocks at once and single ones after them,
    an odd input width, a bias, inputs of three dimensions; float32 sums, rounded once to bfloat16. bfloat16 of even
    width takes the paired layout and its dot products where the CPU has them (.ci/run runs this file on both
    paths)."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    packed = pack(weight)
    for rows in [*range(1, 14), 47, 48, 49, 100]:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        for b in (None, bias):
            got = torch.ops.ferry_kernels.linear(x, packed, out_features, b)
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            assert got.shape == (rows, out_features) and got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # sums of up to 256 terms of ~1
            else:  # one rounding of a float32 sum: at most one bfloat16 step away from torch's rounding of its own
                torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-2, rtol=2**-7)
    x = torch.randn(2, 3, in_features, generator=generator).to(dtype)
    assert torch.ops.ferry_kernels.linear(x, packed, out_features, None).shape == (2, 3, out_features)


@pytest.fixture
def linear_helper() -> Iterator[None]:
    """The blocked linears' helper thread switched on for a test, on one torch thread (where it takes part)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    set_linear_helper(True)
    try:
        yield
    finally:
        set_linear_helper(False)
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the helper thread needs a second core to run on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_helper_threads_blocks_are_the_callers_own_bit_for_bit(linear_helper: None, dtype: torch.dtype) -> None:
    """With the helper on, a linear's blocks are split between the caller and the helper thread as each claims them
    (engine/kernels/helping.h); every block is computed by the same code either way, so the outputs are the
    helper-off outputs bit for bit, however they were split. Calls repeat until the helper has taken blocks
    (it spins while idle, so it does within a few calls on a machine with a core to spare)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(1000, 256, generator=generator).to(dtype)
    packed = pack(weight)
    inputs = [torch.randn(rows, 256, generator=generator).to(dtype) for rows in (1, 2, 5)]
    set_linear_helper(False)
    wanted = [torch.ops.ferry_kernels.linear(x, packed, 1000, None) for x in inputs]
    set_linear_helper(True)
    helped = torch.ops.ferry_kernels.linear_helper_blocks()
    deadline = time.monotonic() + 30
    kept = []  # every output stays alive: a block left unwritten must not find the last call's values in reused memory
    while torch.ops.ferry_kernels.linear_helper_blocks() == helped and time.monotonic() < deadline:
        for x, want in zip(inputs, wanted, strict=True):
            kept.append(torch.ops.ferry_kernels.linear(x, packed, 1000, None))
            assert torch.equal(kept[-1], want)
    assert torch.ops.ferry_kernels.linear_helper_blocks() > helped, "the helper never took a block"


@needs_kernel
def test_callers_on_several_threads_share_the_helper_safely(linear_helper: None) -> None:
    """One job holds the helper at a time: a caller that finds it busy runs its blocks itself."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(640, 128, generator=generator)
    packed = pack(weight)
    x = torch.randn(3, 128, generator=generator)
    set_linear_helper(False)
    want = torch.ops.ferry_kernels.linear(x, packed, 640, None)
    set_linear_helper(True)

    def calls() -> bool:
        torch.set_num_threads(1)
        outputs = [torch.ops.ferry_kernels.linear(x, packed, 640, None) for _ in range(300)]  # fresh memory each
        return all(torch.equal(out, want) for out in outputs)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda _: calls(), range(4)))


@needs_kernel
def test_the_kernel_refuses_what_does_not_fit() -> None:
    packed = pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.ferry_kernels.linear(torch.randn(3, 9), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.ferry_kernels.linear(torch.randn(3, 8), packed, 40, None)


@needs_kernel
@pytest.mark.parametrize("out_features", [1, 16, 37])
def test_rows_come_back_out_of_the_blocked_layout_exactly(out_features: int) -> None:
    weight = torch.randn(out_features, 11).to(torch.bfloat16)
    packed = pack(weight)
    assert packed.shape == (-(-out_features // 16), 11, 16)
    ids = torch.randint(0, out_features, (3, 5))
    assert torch.equal(embed_rows(packed, ids), weight[ids])
    assert torch.equal(embed_rows(pack(weight.float()), ids.int()), weight.float()[ids]), "float32, int32 ids"
    assert embed_rows(packed, ids[:0]).shape == (0, 5, 11)
    many = torch.randint(0, out_features, (40, 100))  # a prefill's worth, over the threads
    assert torch.equal(embed_rows(packed, many), weight[many])
    assert not packed.transpose(1, 2).reshape(-1, 11)[out_features:].any(), "the last block is padded with zeros"
    with pytest.raises(RuntimeError, match="out of range"):
        embed_rows(packed, torch.tensor([-(-out_features // 16) * 16]))
    with pytest.raises(RuntimeError, match="integer ids"):
        embed_rows(packed, torch.tensor([0.0]))


@needs_kernel
@pytest.mark.parametrize("out_features", [1, 16, 37])
def test_bfloat16_goes_in_pairs_along_k_where_the_cpu_has_its_dot_products(out_features: int) -> None:
    """[blocks, in / 2, 16, 2] where `vdpbf16ps` multiplies it (an even width), the plain blocks elsewhere; rows
    come back exactly either way."""
    weight = torch.randn(out_features, 12).to(torch.bfloat16)
    packed = pack(weight)
    blocks = -(-out_features // 16)
    if bf16_dot_products():
        assert packed.shape == (blocks, 6, 16, 2)
        j, t = (out_features - 1) % 16, 1
        assert torch.equal(packed[blocks - 1, 4, j, t], weight[out_features - 1, 2 * 4 + t])
        assert not packed.transpose(1, 2).reshape(-1, 12)[out_features:].any(), "the last block is zero-padded"
    else:
        assert packed.shape == (blocks, 12, 16)
    assert pack(torch.randn(out_features, 11).to(torch.bfloat16)).dim() == 3, "an odd width has no pairs"
    assert pack(torch.randn(out_features, 12)).dim() == 3, "float32 has no pairs"
    ids = torch.randint(0, out_features, (3, 5))
    assert torch.equal(embed_rows(packed, ids), weight[ids])


@needs_kernel
def test_a_blocked_layer_loads_its_shards_then_packs() -> None:
    layer = MergedColumnParallelLinear(8, [20, 12], bias=True, method=BlockedLinearMethod())
    gate, up, bias = torch.randn(20, 8), torch.randn(12, 8), torch.randn(32)
    layer.weight_loader("weight", gate, 0)
    layer.weight_loader("bias", bias[:20], 0)
    assert "weight" in dict(layer.named_parameters())
    layer.weight_loader("weight", up, 1)
    layer.weight_loader("bias", bias[20:], 1)
    assert "weight" not in dict(layer.named_parameters()) and layer.blocked_weight.shape == (2, 8, 16)
    x = torch.randn(5, 8)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gate, up]), bias), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_tied_head_keeps_the_one_matrix_and_the_embedding_reads_rows_from_it() -> None:
    """Over two tensor-parallel ranks: each rank's head packs its rows of the embedding's matrix, the embedding
    drops its plain copy, and lookups and logits are those of the plain matrix."""
    table = torch.randn(37, 8)
    ids = torch.tensor([0, 5, 18, 19, 36])
    hidden = torch.randn(4, 8)
    embeddings, logits = [], []
    for rank in range(2):
        embedding = VocabParallelEmbedding(37, 8, shard=Shard(rank, 2))
        head = ParallelLMHead(37, 8, method=BlockedLinearMethod(), shard=Shard(rank, 2), tied=True)
        head.tie_to(embedding)
        assert not head.loaded
        embedding.weight_loader("weight", table)
        assert head.loaded and not hasattr(embedding, "weight") and not hasattr(head, "weight")
        embeddings.append(embedding)
        logits.append(head(hidden))
    assert torch.equal(sum(e(ids) for e in embeddings), table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=1)[:, :37], hidden @ table.t(), atol=1e-5, rtol=1e-5)


_TINY_SOURCE = """
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor twice(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(ferry_build_test, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(ferry_build_test, CPU, m) { m.impl("twice", &twice); }
"""

_HOLD_LOCK = """
import fcntl, sys, time
lock = open(sys.argv[1], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(600)
"""


def test_library_names_follow_content_and_flags_not_paths(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for source in (first, second):
        source.parent.mkdir()
        source.write_text(_TINY_SOURCE)
    avx2 = ["-O3", "-mavx2", "-mfma"]
    avx512 = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]
    assert library_name("k", [first], avx2) == library_name("k", [second], avx2), "another checkout, the same build"
    assert library_name("k", [first], avx2) != library_name("k", [first], avx512)
    second.write_text(_TINY_SOURCE + "// edited\n")
    assert library_name("k", [first], avx2) != library_name("k", [second], avx2)


def test_a_build_survives_a_killed_builder_and_is_found_from_another_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed while it held the build lock, and the half-built folder a stopped build left, hold no
    later start up: a waiter gives up after its bound (the caller falls back), the next start builds. A checkout at
    another path then loads that build without compiling."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    source = tmp_path / "checkout" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text(_TINY_SOURCE)
    root = tmp_path / "cache" / "ferry"
    root.mkdir(parents=True)
    name = library_name("ferry_build_test", [source], build_flags())
    (root / f".{name}-halfway").mkdir()
    (root / f".{name}-halfway" / "build.ninja").write_text("stopped halfway")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(root / f"{name}.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        with pytest.raises(KernelUnavailable, match="another process has been building"):
            load_library("ferry_build_test", [source], "test kernel", wait_s=1.0)
        assert time.monotonic() - started < 10
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the lock: the OS releases it
        holder.wait()
    with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
        built = load_library("ferry_build_test", [source], "test kernel", wait_s=5.0)
    assert "building the test kernel" in caplog.text
    assert built == root / name / f"{name}.so" and built.exists()
    assert not list(root.glob(f".{name}-*")), "the stopped build's folder and this build's are gone"
    assert torch.equal(torch.ops.ferry_build_test.twice(torch.ones(2)), torch.full((2,), 2.0))

    moved = tmp_path / "elsewhere" / "tiny.cpp"
    moved.parent.mkdir()
    shutil.copy(source, moved)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.kernels.build"):
        assert load_library("ferry_build_test", [moved], "test kernel") == built
    assert "building" not in caplog.text


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_kernel_computes_what_the_llama_norm_does(dtype: torch.dtype) -> None:
    """float32 sums and scale, the normalised row rounded to the dtype before the weight multiplies it: bfloat16
    bit for bit, float32 to rounding; rows of any leading shape, a strided view (Qwen3's q/k norm) included."""
    from engine.layers.norm import RMSNorm

    generator = torch.Generator().manual_seed(7)
    norm = RMSNorm(48, 1e-6).to(dtype)
    norm.weight.data = torch.randn(48, generator=generator).to(dtype)
    fused = torch.randn(5, 3 * 48, generator=generator).to(dtype)
    for x in (torch.randn(1, 48, generator=generator).to(dtype), fused[:, :96].view(5, 2, 48)):
        want = norm.weight * F.rms_norm(x.float(), (48,), eps=1e-6).to(dtype)
        got = norm(x)
        assert got.shape == x.shape and got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pointwise_kernels_compute_the_layer_expressions(dtype: torch.dtype) -> None:
    """Rotary embedding (of a strided q view, as the fused QKV output gives it) and SiLU-and-multiply, against the
    torch expressions engine/layers/rotary.py and the MLP run elsewhere: bfloat16 bit for bit, float32 to rounding."""
    from engine.layers.rotary import _rotate_half

    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 8 * 32 + 64, generator=generator).to(dtype)
    q = qkv[:, : 8 * 32].view(5, 8, 32)
    cos, sin = (torch.randn(5, 1, 32, generator=generator).to(dtype) for _ in range(2))
    gate_up = torch.randn(3, 2 * 40, generator=generator).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    pairs = [
        (torch.ops.ferry_kernels.rotary(q, cos, sin), q * cos + _rotate_half(q) * sin),
        (torch.ops.ferry_kernels.silu_mul(gate_up), F.silu(gate) * up),
    ]
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
