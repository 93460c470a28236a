"""The state-space step maths (engine/layers/ssm.py) against a position-by-position reference: any split of
sequences into steps (decodes and prompt chunks mixed in one step, any chunk lengths) gives each sequence the
outputs and final state of running it alone, token by token, from a zero state; a reused slot's old state is never
read by a sequence starting afresh."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.layers.ssm import StateStep, causal_conv, selective_scan, ssd_scan

D, N, K = 6, 4, 4  # channels, state size, convolution width
H, P, G = 4, 3, 2  # Mamba2 heads, head width, groups


def _reference_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    padded = torch.cat([torch.zeros(K - 1, x.shape[1]), x])
    return F.silu(torch.stack([(padded[t : t + K].T * weight).sum(-1) + bias for t in range(len(x))]))


def _reference_mamba(u, dt, A, B, C):
    h = torch.zeros(D, N)
    ys = []
    for t in range(len(u)):
        h = torch.exp(dt[t][:, None] * A) * h + (dt[t] * u[t])[:, None] * B[t][None, :]
        ys.append(h @ C[t])
    return torch.stack(ys), h


def _reference_mamba2(x, dt, A, B, C):
    h = torch.zeros(H, P, N)
    Bh, Ch = B.repeat_interleave(H // G, dim=1), C.repeat_interleave(H // G, dim=1)
    ys = []
    for t in range(len(x)):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * Bh[t][:, None, :]
        ys.append((h @ Ch[t][..., None]).squeeze(-1))
    return torch.stack(ys), h


def _steps(lengths: list[int], chunk: int, draw_order: np.random.Generator) -> list[list[tuple[int, int, int]]]:
    """Steps of (sequence, start, count): every sequence advances by up to `chunk` tokens per step, sequences
    joining at different steps (so that decodes and chunks share steps)."""
    done = [0] * len(lengths)
    joins = draw_order.integers(0, 3, size=len(lengths))
    steps = []
    step_no = 0
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        step = []
        for s, n in enumerate(lengths):
            if done[s] < n and joins[s] <= step_no:
                count = min(n - done[s], chunk if done[s] == 0 else int(draw_order.integers(1, chunk + 1)))
                step.append((s, done[s], count))
                done[s] += count
        if step:
            steps.append(step)
        step_no += 1
    return steps


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    chunk=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_any_split_into_steps_matches_running_each_sequence_alone(
    kernel: bool, lengths: list[int], chunk: int, seed: int
) -> None:
    """Through the C++ kernels (engine/kernels/cpu_ssm.cpp) and through torch's ops alike."""
    gen = torch.Generator().manual_seed(seed)
    order = np.random.default_rng(seed)
    seqs = []
    for n in lengths:
        seqs.append(
            dict(
                x=torch.randn(n, D, generator=gen),
                dt=F.softplus(torch.randn(n, D, generator=gen)),
                B=torch.randn(n, N, generator=gen),
                C=torch.randn(n, N, generator=gen),
                x2=torch.randn(n, H, P, generator=gen),
                dt2=F.softplus(torch.randn(n, H, generator=gen)),
                B2=torch.randn(n, G, N, generator=gen),
                C2=torch.randn(n, G, N, generator=gen),
            )
        )
    weight, bias = torch.randn(D, K, generator=gen), torch.randn(D, generator=gen)
    A = -torch.rand(D, N, generator=gen) * 2
    A2 = -torch.rand(H, generator=gen) * 2
    # Slots hold garbage (a previous request's state, non-finite even): a fresh start must not read it.
    num_slots = len(lengths) + 2
    slots = order.permutation(num_slots)[: len(lengths)]
    conv_states = torch.full((num_slots, D, K - 1), float("nan"))
    ssm_states = torch.full((num_slots, N, D), float("inf"))
    ssd_states = torch.full((num_slots, H, P, N), float("nan"))
    outs = {name: [[] for _ in lengths] for name in ("conv", "scan", "ssd")}
    for step_seqs in _steps(lengths, chunk, order):
        cu = np.cumsum([0] + [count for _, _, count in step_seqs])
        step = StateStep.of(
            cu,
            np.array([slots[s] for s, _, _ in step_seqs]),
            np.array([start == 0 for _, start, _ in step_seqs]),
            torch.device("cpu"),
        )

        def packed(name: str) -> torch.Tensor:
            return torch.cat([seqs[s][name][start : start + n] for s, start, n in step_seqs])  # noqa: B023

        conv = causal_conv(packed("x"), conv_states, weight, bias, step, kernel)
        scan = selective_scan(packed("x"), packed("dt"), A, packed("B"), packed("C"), ssm_states, step, kernel)
        ssd = ssd_scan(packed("x2"), packed("dt2"), A2, packed("B2"), packed("C2"), ssd_states, step, kernel)
        for i, (s, _, _) in enumerate(step_seqs):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            outs["conv"][s].append(conv[rows])
            outs["scan"][s].append(scan[rows])
            outs["ssd"][s].append(ssd[rows])
    for s, seq in enumerate(seqs):
        torch.testing.assert_close(torch.cat(outs["conv"][s]), _reference_conv(seq["x"], weight, bias))
        ys, h = _reference_mamba(seq["x"], seq["dt"], A, seq["B"], seq["C"])
        torch.testing.assert_close(torch.cat(outs["scan"][s]), ys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ssm_states[slots[s]].T, h, rtol=1e-4, atol=1e-4)
        ys2, h2 = _reference_mamba2(seq["x2"], seq["dt2"], A2, seq["B2"], seq["C2"])
        torch.testing.assert_close(torch.cat(outs["ssd"][s]), ys2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ssd_states[slots[s]], h2, rtol=1e-4, atol=1e-4)
        tail = seq["x"][-(K - 1) :]
        torch.testing.assert_close(conv_states[slots[s]][:, -len(tail) :], tail.T)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("length", [63, 64, 65, 200])
def test_ssd_chunk_boundaries(length: int, kernel: bool) -> None:
    """A prompt longer than one SSD chunk: the chunk states carry across exactly."""
    gen = torch.Generator().manual_seed(length)
    x, dt = torch.randn(length, H, P, generator=gen), F.softplus(torch.randn(length, H, generator=gen)) * 0.1
    B, C = torch.randn(length, G, N, generator=gen), torch.randn(length, G, N, generator=gen)
    A = -torch.rand(H, generator=gen)
    states = torch.zeros(1, H, P, N)
    step = StateStep.of(np.array([0, length]), np.array([0]), np.array([True]), torch.device("cpu"))
    ys = ssd_scan(x, dt, A, B, C, states, step, kernel)
    ref, h = _reference_mamba2(x, dt, A, B, C)
    torch.testing.assert_close(ys, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[0], h, rtol=1e-4, atol=1e-4)
