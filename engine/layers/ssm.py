"""The state-space layers' step maths: a causal convolution and a selective scan over the packed `[T, ...]` row,
each sequence continuing the state its slot holds (engine/core/state_slots.py) and leaving its new state there.

On the CPU each runs as one C++ kernel over the packed row as it is (engine/kernels/cpu_ssm.cpp): a sequence's
state read from its slot once, carried across its tokens, written back once. The torch path (GPU, and the reference
the kernels are tested by, tests/test_ssm.py) splits a step's sequences in two kinds (`StateStep`): those computing
one token (decodes) update their state in one batched recurrence step, with no padding; the others (prompt chunks)
are gathered into a padded `[sequences, longest, ...]` block and scanned together, padding rows contributing
nothing (a zero time step leaves a state unchanged). Either way a sequence whose step starts at position 0 starts
from a zero state, whatever its slot held before: a slot is reused without being cleared, and a request resumed
after preemption recomputes its state from its first token.

Mamba's selective scan (one decay per channel and state element) runs in torch as a recurrence over the block's
positions; Mamba2's (one scalar decay per head) as the chunked "state-space duality" form: within a chunk a masked
attention-like product, across chunks a short recurrence of chunk states. Both in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.library import cpu_kernels_take


@dataclass(frozen=True)
class StateStep:
    """Where a step's sequences' tokens lie in the packed row, and their state slots, split by kind."""

    num_tokens: int
    decode_tokens: torch.Tensor  # [Bd] int64: the packed row of each one-token sequence's token
    decode_slots: torch.Tensor  # [Bd] int64
    decode_fresh: torch.Tensor  # [Bd] bool: starts from a zero state (its first token)
    scan_index: torch.Tensor  # [Bs, L] int64: packed rows of each longer sequence's tokens, `num_tokens` past its end
    scan_valid: torch.Tensor  # [Bs, L] bool
    scan_lens: torch.Tensor  # [Bs] int64
    scan_slots: torch.Tensor  # [Bs] int64
    scan_fresh: torch.Tensor  # [Bs] bool
    scan_tokens: torch.Tensor  # [Ts] int64: `scan_index[scan_valid]`, the rows a padded block scatters back to
    has_decodes: bool
    has_scans: bool
    query_start: torch.Tensor  # [B + 1] int64: every sequence's rows, as the CPU kernels read the step
    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B] bool

    @classmethod
    def of(cls, query_start_loc: np.ndarray, slots: np.ndarray, fresh: np.ndarray, device: torch.device) -> StateStep:
        """From the step's cumulative query starts `[B + 1]`, each sequence's state slot `[B]` and whether it starts
        at position 0 `[B]` (host arrays)."""
        lens = np.diff(query_start_loc)
        one = lens == 1
        longer = ~one
        scan_lens = lens[longer]
        width = int(scan_lens.max()) if scan_lens.size else 0
        offsets = np.arange(width)
        valid = offsets[None, :] < scan_lens[:, None]
        total = int(query_start_loc[-1])
        index = np.where(valid, query_start_loc[:-1][longer][:, None] + offsets[None, :], total)

        def put(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

        return cls(
            num_tokens=total,
            decode_tokens=put(query_start_loc[:-1][one]),
            decode_slots=put(slots[one]),
            decode_fresh=put(fresh[one], torch.bool),
            scan_index=put(index),
            scan_valid=put(valid, torch.bool),
            scan_lens=put(scan_lens),
            scan_slots=put(slots[longer]),
            scan_fresh=put(fresh[longer], torch.bool),
            scan_tokens=put(index[valid]),
            has_decodes=bool(one.any()),
            has_scans=bool(longer.any()),
            query_start=put(query_start_loc),
            slots=put(slots),
            fresh=put(fresh, torch.bool),
        )

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> the scanned sequences' rows `[Bs, L, ...]`, zeros past each one's end."""
        return torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])[self.scan_index]


def _start_states(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The slots' states, zero where a sequence starts afresh (`where`, not a product: a reused slot may hold
    anything, a non-finite state of a request that ended included)."""
    held = states[slots]
    return torch.where(fresh.view(-1, *([1] * (held.dim() - 1))), torch.zeros((), dtype=held.dtype), held)


def causal_conv(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    step: StateStep,
    kernel: bool = True,
) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of each sequence's channels `x` `[T, C]` with `weight` `[C, K]`,
    continuing from the last `K - 1` inputs its slot holds (`conv_states` `[slots, C, K - 1]`), which it leaves
    there updated. Returns `[T, C]`. `kernel`: the C++ kernel where it runs (engine/kernels/cpu_ssm.cpp); False:
    torch's ops (the reference the kernel is tested by)."""
    if kernel and cpu_kernels_take(x) and conv_states.dtype == x.dtype and conv_states.is_contiguous():
        return torch.ops.ferry_kernels.causal_conv(
            x, conv_states, weight, bias, step.slots, step.fresh, step.query_start
        )
    out = torch.empty_like(x)
    width = weight.shape[1]
    if step.has_decodes:
        held = _start_states(conv_states, step.decode_slots, step.decode_fresh)  # [Bd, C, K-1]
        window = torch.cat([held, x[step.decode_tokens].unsqueeze(-1).to(held.dtype)], dim=-1)  # [Bd, C, K]
        summed = (window * weight).sum(-1)
        if bias is not None:
            summed = summed + bias
        out[step.decode_tokens] = F.silu(summed).to(x.dtype)
        conv_states[step.decode_slots] = window[:, :, 1:]
    if step.has_scans:
        held = _start_states(conv_states, step.scan_slots, step.scan_fresh)  # [Bs, C, K-1]
        inputs = torch.cat([held, step.padded(x).transpose(1, 2).to(held.dtype)], dim=-1)  # [Bs, C, K-1+L]
        conv = F.conv1d(inputs, weight.unsqueeze(1), bias, groups=weight.shape[0])  # [Bs, C, L]
        out[step.scan_tokens] = F.silu(conv.transpose(1, 2)[step.scan_valid]).to(x.dtype)
        # The last K - 1 inputs of each sequence: positions lens .. lens + K - 2 of `inputs`.
        tail = step.scan_lens[:, None] + torch.arange(width - 1, device=x.device)
        conv_states[step.scan_slots] = inputs.gather(-1, tail[:, None, :].expand(-1, inputs.shape[1], -1))
    return out


def selective_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    states: torch.Tensor,
    step: StateStep,
    kernel: bool = True,
) -> torch.Tensor:
    """Mamba's selective scan: per channel d and state element n, `h = exp(dt·A[d, n])·h + dt·B[n]·u[d]`, output
    `Σ_n C[n]·h[d, n]`. `u`, `dt` `[T, D]` (dt after softplus), `A` `[D, N]`, `B`, `C` `[T, N]`, `states`
    `[slots, N, D]` float32 (state element-major, so the kernel runs across channels), continued and updated.
    Returns `[T, D]` float32. `kernel`: as `causal_conv`'s."""
    u, dt, B, C = u.float(), dt.float(), B.float(), C.float()
    if kernel and cpu_kernels_take(states):
        return torch.ops.ferry_kernels.selective_scan(
            states, step.slots, step.fresh, step.query_start, u, dt, A.t().contiguous(), B, C
        )
    states = states.transpose(1, 2)  # [slots, D, N]: a view, written through
    out = torch.empty_like(u)
    if step.has_decodes:
        rows = step.decode_tokens
        h = _start_states(states, step.decode_slots, step.decode_fresh)  # [Bd, D, N]
        step_dt = dt[rows]
        h = torch.exp(step_dt[..., None] * A) * h + (step_dt * u[rows])[..., None] * B[rows][:, None, :]
        out[rows] = (h @ C[rows][..., None]).squeeze(-1)
        states[step.decode_slots] = h
    if step.has_scans:
        h = _start_states(states, step.scan_slots, step.scan_fresh)  # [Bs, D, N]
        block_dt = step.padded(dt)  # [Bs, L, D]; padding rows have dt 0: exp(0) keeps the state, 0 adds nothing
        decay = torch.exp(block_dt[..., None] * A)  # [Bs, L, D, N]
        inputs = (block_dt * step.padded(u))[..., None] * step.padded(B)[:, :, None, :]  # [Bs, L, D, N]
        block_C = step.padded(C)[..., None]  # [Bs, L, N, 1]
        ys = torch.empty_like(block_dt)
        for t in range(block_dt.shape[1]):
            h = decay[:, t] * h + inputs[:, t]
            ys[:, t] = (h @ block_C[:, t]).squeeze(-1)
        out[step.scan_tokens] = ys[step.scan_valid]
        states[step.scan_slots] = h
    return out


SSD_CHUNK = 64
"""Positions per chunk of the state-space-duality scan: the quadratic part is `[chunk, chunk]` per head."""


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    states: torch.Tensor,
    step: StateStep,
    kernel: bool = True,
) -> torch.Tensor:
    """Mamba2's scan, one scalar decay per head: `h = exp(dt·A[h])·h + dt·x ⊗ B`, output `h·C`. `x` `[T, H, P]`,
        `dt` `[T, H]` (after softplus), `A` `[H]`, `B`, `C` `[T, G, N]` (groups shared by `H / G` heads each),
        `states` `[slots, H, P, N]` float32, continued and updated. Returns `[T, H, P]` float32. `kernel`: as
    `selective_scan`'s."""
    heads = x.shape[1]
    repeat = heads // B.shape[1]
    x, dt, B_groups, C_groups = x.float(), dt.float(), B.float(), C.float()
    if kernel and cpu_kernels_take(states):
        return torch.ops.ferry_kernels.ssd_scan(
            states, step.slots, step.fresh, step.query_start, x, dt, A.contiguous(), B_groups, C_groups
        )
    out = torch.empty_like(x)
    if step.has_decodes:
        rows = step.decode_tokens
        B, C = B_groups.repeat_interleave(repeat, dim=1), C_groups.repeat_interleave(repeat, dim=1)  # [T, H, N]
        h = _start_states(states, step.decode_slots, step.decode_fresh)  # [Bd, H, P, N]
        step_dt = dt[rows]  # [Bd, H]
        h = (
            torch.exp(step_dt * A)[..., None, None] * h
            + (step_dt[..., None] * x[rows])[..., None] * B[rows][:, :, None, :]
        )
        out[rows] = (h @ C[rows][..., None]).squeeze(-1)
        states[step.decode_slots] = h
    if step.has_scans:
        ys, final = _ssd_chunks(
            step.padded(x),
            step.padded(dt),
            A,
            step.padded(B_groups),
            step.padded(C_groups),
            _start_states(states, step.scan_slots, step.scan_fresh),
        )
        out[step.scan_tokens] = ys[step.scan_valid]
        states[step.scan_slots] = final
    return out


def _ssd_chunks(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan of padded blocks: `x` `[Bs, L, H, P]`, `dt` `[Bs, L, H]`, `B`, `C` `[Bs, L, G, N]`, start
    states `h0` `[Bs, H, P, N]` -> outputs `[Bs, L, H, P]` and the states after position L - 1.

    Laid out `[.., G, R, l, ..]` (R heads per group) so that every product is a batched matmul over contiguous
    matrices, and C·Bᵀ, which the heads of a group share, is computed once per group."""
    batch, length, heads, width = x.shape
    groups, size_n = B.shape[2], B.shape[3]
    per_group = heads // groups
    size = min(SSD_CHUNK, length)
    chunks = -(-length // size)
    pad = chunks * size - length  # zero time steps: no decay, no input

    def chunked(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, chunks, size, *t.shape[2:])

    # [b, c, G, R, l, P] inputs scaled by their time steps; [b, c, G, l, N] B and C; [b, c, G, R, l] log decays.
    xdt = chunked(x * dt[..., None]).view(batch, chunks, size, groups, per_group, width).permute(0, 1, 3, 4, 2, 5)
    B_c = chunked(B).permute(0, 1, 3, 2, 4)
    C_c = chunked(C).permute(0, 1, 3, 2, 4)
    log_decay = torch.cumsum(chunked(dt * A), dim=2)  # each position's decay since its chunk's start
    log_decay = log_decay.view(batch, chunks, size, groups, per_group).permute(0, 1, 3, 4, 2)
    # Within a chunk: output i reads input j <= i decayed by exp(log_decay[i] - log_decay[j]).
    gap = log_decay[..., :, None] - log_decay[..., None, :]  # [b, c, G, R, i, j]
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    weights = torch.exp(gap.masked_fill(~causal, float("-inf"))) * (C_c @ B_c.transpose(-1, -2)).unsqueeze(3)
    y = weights @ xdt  # [b, c, G, R, l, P]
    # Each chunk's own contribution to the state at its end `[b, c, G, R, P, N]`, then the chunks' start states.
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # [b, c, G, R, l]
    added = xdt.transpose(-1, -2) @ (B_c.unsqueeze(3) * to_end[..., None])
    chunk_decay = torch.exp(log_decay[..., -1])  # [b, c, G, R]
    h = h0.view(batch, groups, per_group, width, size_n)
    starts = []
    for c in range(chunks):
        starts.append(h)
        h = chunk_decay[:, c, ..., None, None] * h + added[:, c]
    start_states = torch.stack(starts, dim=1)  # [b, c, G, R, P, N]
    y = y + (C_c.unsqueeze(3) @ start_states.transpose(-1, -2)) * torch.exp(log_decay)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(batch, chunks * size, heads, width)
    return y[:, :length], h.reshape(batch, heads, width, size_n)
