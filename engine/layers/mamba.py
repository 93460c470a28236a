"""State-space mixers on the packed `[T, hidden]` row: Mamba's (selective scan, a decay per channel and state
element; Jamba's adds RMSNorms on its time step, B and C) and Mamba2's (a scalar decay per head, grouped B and C,
a gated RMSNorm before the output projection; Granite 4's hybrids use it too).

Each takes its layer's cache, the pair (convolution states `[slots, channels, K - 1]`, scan states
`[slots, ...]`) that its `RecurrentStateSpec` declares, and reads the step's sequences' slots from the step context
(engine/layers/ssm.py's `StateStep`). The maths follows transformers' torch paths; parameters are named as their
checkpoints name them, so a model loads them by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.context import step_states
from engine.attention.spec import RecurrentStateSpec
from engine.layers.linear import ReplicatedLinear
from engine.layers.linear_method import LinearMethod
from engine.layers.norm import RMSNorm
from engine.layers.ssm import causal_conv, selective_scan, ssd_scan


def _weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Falcon-Mamba's norm of the time step, B and C: RMS-normalised in float32, no weight."""
    rows = x.float()
    return (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MambaMixer(nn.Module):
    """Mamba's mixer: in_proj to (x, gate), causal convolution of x, x_proj to (time step, B, C), dt_proj, the
    selective scan, `y + D·x` gated by SiLU(gate), out_proj. `inner_norms_eps`: RMSNorms on the time step, B and C
    before dt_proj and the scan, Jamba's with weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`), Falcon-Mamba's
    without (`weighted_norms=False`)."""

    def __init__(
        self,
        hidden: int,
        width: int,
        state_size: int,
        conv_width: int,
        time_step_rank: int,
        *,
        conv_bias: bool,
        proj_bias: bool,
        method: LinearMethod,
        inner_norms_eps: float | None = None,
        weighted_norms: bool = True,
    ) -> None:
        super().__init__()
        self.width, self.state_size, self.rank = width, state_size, time_step_rank
        self.in_proj = ReplicatedLinear(hidden, 2 * width, bias=proj_bias, method=method)
        # Held as transformers' Conv1d holds them (`[width, 1, K]`), so the checkpoint's tensors load as they are.
        self.conv1d = nn.Conv1d(width, width, conv_width, groups=width, bias=conv_bias)
        self.x_proj = ReplicatedLinear(width, time_step_rank + 2 * state_size, bias=False, method=method)
        self.dt_proj = ReplicatedLinear(time_step_rank, width, bias=True, method=method)
        self.A_log = nn.Parameter(torch.empty(width, state_size), requires_grad=False)
        self.D = nn.Parameter(torch.empty(width), requires_grad=False)
        self.out_proj = ReplicatedLinear(width, hidden, bias=proj_bias, method=method)
        self.inner_norms_eps = inner_norms_eps
        self.weighted_norms = weighted_norms
        if inner_norms_eps is not None and weighted_norms:
            self.dt_layernorm = RMSNorm(time_step_rank, inner_norms_eps)
            self.b_layernorm = RMSNorm(state_size, inner_norms_eps)
            self.c_layernorm = RMSNorm(state_size, inner_norms_eps)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        # The scan state state-element-major, `[N, width]`: the CPU kernel runs across channels (engine/layers/ssm.py).
        return RecurrentStateSpec((self.width, self.conv1d.kernel_size[0] - 1), (self.state_size, self.width), dtype)

    def forward(self, hidden: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step = step_states()
        conv_states, scan_states = cache
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)  # [T, width] each
        x = causal_conv(x, conv_states, self.conv1d.weight.squeeze(1), self.conv1d.bias, step)
        time_step, B, C = self.x_proj(x).split([self.rank, self.state_size, self.state_size], dim=-1)
        if self.inner_norms_eps is not None and self.weighted_norms:
            time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
        elif self.inner_norms_eps is not None:
            time_step, B, C = (_weightless_rms_norm(t, self.inner_norms_eps) for t in (time_step, B, C))
        dt = F.softplus(self.dt_proj(time_step).float())
        A = -torch.exp(self.A_log.float())
        y = selective_scan(x, dt, A, B, C, scan_states, step)  # [T, width] float32
        y = (y + x.float() * self.D.float()) * F.silu(gate.float())
        return self.out_proj(y.to(hidden.dtype))


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: `x · SiLU(gate)`, RMS-normalised per group of `group_size` channels, in float32."""

    def __init__(self, width: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = x.float() * F.silu(gate.float())
        grouped = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.view_as(gated).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba2's mixer: in_proj to (gate, x·B·C, time step per head), causal convolution of x·B·C, the chunked
    scan, `y + D·x`, the gated RMSNorm, out_proj."""

    def __init__(
        self,
        hidden: int,
        width: int,
        heads: int,
        head_dim: int,
        groups: int,
        state_size: int,
        conv_width: int,
        *,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        time_step_limit: tuple[float, float],
        method: LinearMethod,
    ) -> None:
        super().__init__()
        if heads * head_dim != width or heads % groups:
            raise ValueError(f"{heads} heads of {head_dim} for width {width} in {groups} groups")
        self.width, self.heads, self.head_dim, self.groups, self.state_size = width, heads, head_dim, groups, state_size
        self.conv_channels = width + 2 * groups * state_size
        self.in_proj = ReplicatedLinear(hidden, width + self.conv_channels + heads, bias=proj_bias, method=method)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, conv_width, groups=self.conv_channels,
                                bias=conv_bias)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.norm = GatedRMSNorm(width, width // groups, eps)
        self.out_proj = ReplicatedLinear(width, hidden, bias=proj_bias, method=method)
        low, high = time_step_limit
        self.time_step_limit = None if (low, high) == (0.0, float("inf")) else (low, high)

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            (self.conv_channels, self.conv1d.kernel_size[0] - 1), (self.heads, self.head_dim, self.state_size), dtype
        )

    def forward(self, hidden: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step = step_states()
        conv_states, scan_states = cache
        tokens = hidden.shape[0]
        gate, xBC, time_step = self.in_proj(hidden).split([self.width, self.conv_channels, self.heads], dim=-1)
        xBC = causal_conv(xBC, conv_states, self.conv1d.weight.squeeze(1), self.conv1d.bias, step)
        x, B, C = xBC.split([self.width, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        dt = F.softplus(time_step.float() + self.dt_bias.float())  # [T, heads]
        if self.time_step_limit is not None:
            dt = dt.clamp(*self.time_step_limit)
        A = -torch.exp(self.A_log.float())
        x = x.reshape(tokens, self.heads, self.head_dim)
        y = ssd_scan(
            x,
            dt,
            A,
            B.reshape(tokens, self.groups, self.state_size),
            C.reshape(tokens, self.groups, self.state_size),
            scan_states,
            step,
        )  # [T, heads, head_dim] float32
        y = (y + x.float() * self.D.float()[:, None]).reshape(tokens, self.width)
        return self.out_proj(self.norm(y.to(hidden.dtype), gate))
