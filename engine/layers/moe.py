"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token, and each expert multiplies the tokens
routed to it, all of them at once (no loop over tokens).

The experts load stacked (`w13` `[experts, 2 * width, hidden]`: each expert's gate rows over its up rows; `w2`
`[experts, hidden, width]`). On a CPU each expert is then packed for the dense linears' kernel and one C++ op runs
the routed experts (`FusedExperts`); elsewhere a step's (token, expert) pairs, sorted by expert, go through
`torch.nn.functional.grouped_mm` with the experts' offsets: two calls per layer whatever the routing, no host sync
(the offsets stay on the device, so a CUDA graph can hold the layer).

With tensor parallelism every rank holds every expert's slice of the width (Megatron's MLP split, per expert):
gate/up rows column-parallel, down columns row-parallel, and the caller all-reduces the partial sums once, together
with any shared expert's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.library import cpu_kernels_available
from engine.layers.linear import ONE_RANK, Shard
from engine.layers.linear_method import (
    ROWS_HINT,
    BlockedLinearMethod,
    PackedLinearMethod,
    select_linear_method,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


EXPERT_PARTS = ("gate", "up", "down")
"""An expert's three matrices: `gate` and `up` `[width, hidden]`, `down` `[hidden, width]` (nn.Linear's layout)."""


@dataclass(frozen=True)
class Routing:
    """How a router's logits pick and weigh experts: softmax over all experts, the `top_k` largest, their
    probabilities renormalised to sum to one where `renormalize` (Mixtral always; Qwen's MoE by `norm_topk_prob`);
    or, `softmax_of_top_k`, a softmax over the `top_k` largest logits alone (gpt-oss)."""

    top_k: int
    renormalize: bool
    softmax_of_top_k: bool = False
    """gpt-oss: the `top_k` largest logits, then a softmax over just those."""

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` `[T, experts]` -> (float32 weights `[T, top_k]`, expert ids `[T, top_k]`)."""
        if self.softmax_of_top_k:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=torch.float32), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing: experts fall into `num_groups` groups, only the `kept_groups` best groups of a token may
    serve it, and its `top_k` experts are chosen among theirs; the chosen weights times `scaling`.

    V2 (`sigmoid=False`): softmax scores; a group scores its best expert's; experts outside the kept groups score 0
    (`grouped=False`, V2's "greedy": every expert eligible). V3 (`sigmoid=True`): sigmoid scores; experts are chosen
    by score plus a learned correction bias, a group scoring its two best; the weights are the uncorrected scores,
    renormalised to sum to one where `renormalize`. Everything in float32, as transformers computes it."""

    top_k: int
    sigmoid: bool
    grouped: bool
    num_groups: int
    kept_groups: int
    renormalize: bool
    scaling: float

    @classmethod
    def of(cls, config: PretrainedConfig) -> GroupedRouting:
        v3 = config.model_type != "deepseek_v2"  # V3 and GLM
        return cls(
            top_k=config.num_experts_per_tok,
            sigmoid=v3,
            grouped=v3 or config.topk_method == "group_limited_greedy",
            num_groups=config.n_group or 1,
            kept_groups=config.topk_group or 1,
            renormalize=v3 and bool(config.norm_topk_prob),  # V2's router ignores norm_topk_prob
            scaling=config.routed_scaling_factor,
        )

    def select(
        self, logits: torch.Tensor, correction: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, experts] float32 -> (weights [T, top_k] float32, ids [T, top_k])
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores if correction is None else scores + correction
        if self.grouped:
            tokens, experts = choice.shape
            per_group = choice.view(tokens, self.num_groups, experts // self.num_groups)
            group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1) if self.sigmoid else per_group.amax(dim=-1)
            kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.kept_groups, dim=-1)[1], 1.0)
            eligible = kept.bool().unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
            choice = choice.masked_fill(~eligible, float("-inf") if self.sigmoid else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` `[T, top_k]` -> (the order that groups the flattened (token, expert) pairs by expert `[T * top_k]`, each
    expert's pair count `[experts]` int64). A scatter, not bincount, counts them: its size is known before it runs,
    so a compiled graph or a CUDA graph holds it."""
    flat = ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))
    return flat.argsort(stable=True), counts


def mix_back(
    out: torch.Tensor,  # [T * top_k, hidden]: the pairs' outputs, grouped by expert
    order: torch.Tensor,  # [T * top_k]: `group_by_expert`'s
    weights: torch.Tensor,  # [T, top_k] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, hidden]
    """Each token's pairs back in place, weighted by their routing and summed in float32."""
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    tokens, top_k = weights.shape
    return (unsorted.view(tokens, top_k, -1).float() * weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def _every_expert(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, top_k] float32
    ids: torch.Tensor,  # [T, top_k]
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, rows [T, hidden]) -> its outputs [T, hidden]
) -> torch.Tensor:  # [T, hidden]
    """Every token through every expert, each product weighted by its routing weight (zero where not routed): what
    CUDA runs for dtypes `grouped_mm` does not take there (it takes bfloat16), exact and free of host syncs (a CUDA
    graph holds it) at experts / top_k times the arithmetic."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for index in range(num_experts):
        share = (weights * (ids == index)).sum(dim=-1, keepdim=True)  # [T, 1]: 0 for tokens not routed to it
        out += expert(index, x).float() * share
    return out.to(x.dtype)


class PackedOnLoad(nn.Module):
    """Expert weights that load piece by piece and are packed for the CPU kernels (`_pack`) once the last piece is in,
    or when dummy weights were written in place (`finish_loading`)."""

    def __init__(self, pieces: set[object]) -> None:
        super().__init__()
        self._pending = set(pieces)

    @property
    def loaded(self) -> bool:
        return not self._pending

    def finish_loading(self) -> None:
        """Weights were written in place (dummy weights): process them as if each piece had been loaded."""
        self._pending.clear()
        self._pack()

    def _loaded(self, pieces: set[object]) -> None:
        was_pending = bool(self._pending)
        self._pending -= pieces
        if was_pending and not self._pending:
            self._pack()

    def _pack(self) -> None:
        raise NotImplementedError


class FusedExperts(PackedOnLoad):
    """`num_experts` SiLU-gated MLPs of width `width` (this rank's `width / shard.size`), as two stacked tensors.

    On a CPU each expert's matrices are packed, once the last one is in, in the layout the model's dense linears
    take in that dtype (`cpu_pack`), and a step multiplies each routed expert's tokens with it. Measured on the Xeon
    (AVX512-BF16, with the AMX oneDNN uses), one 1536 x 2048 bfloat16 expert on one thread: oneDNN 293 us for one
    row, 291 for 16, 467 for 64 (862 GFLOP/s); the blocked kernel 268, 1061, 3964 (its bfloat16 dot products top out
    near 100 GFLOP/s); `grouped_mm` over all experts took 1.2-3x oneDNN's time. On a Zen 4 EPYC (AVX512-BF16, no
    AMX), against oneDNN's layout, the blocked kernel's paired layout took the MoE rows against vLLM-CPU from 0.97x
    to 1.10x (DeepSeek-V2-Lite's layers, decode-heavy) and 1.01x to 1.08x (Qwen3-30B-A3B's), and a prefill-heavy row
    from 1.14x to 1.02x (BENCHMARKS.md). Elsewhere (CUDA, float16) the stacked tensors and `grouped_mm`.
    """

    def __init__(self, num_experts: int, hidden: int, width: int, shard: Shard = ONE_RANK) -> None:
        super().__init__({(expert, part) for expert in range(num_experts) for part in EXPERT_PARTS})
        if width % shard.size:
            raise ValueError(f"expert width {width} does not divide by {shard.size} tensor-parallel ranks")
        self.num_experts = num_experts
        self.hidden = hidden
        self.width = width // shard.size
        self.shard = shard
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.width, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.width), requires_grad=False)
        self.packed13: tuple[torch.Tensor, ...] | None = None
        self.packed2: tuple[torch.Tensor, ...] | None = None
        """Each expert's gate/up and down matrices in the CPU kernel's layout (`kernel`), once loaded."""
        self.kernel: str = "grouped_mm"
        """`onednn`, `blocked` (the CPU kernels, per expert) or `grouped_mm` (the stacked tensors, all experts)."""

    def missing(self) -> list[str]:
        """The (expert, matrix) pieces not loaded yet, named as `expert.matrix`."""
        return [f"{expert}.{part}" for expert, part in sorted(self._pending)]

    @torch.no_grad()
    def weight_loader(self, expert: int | None, part: str, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of one expert's matrix (`expert` an index, `loaded` nn.Linear's 2-D layout), or of
        every expert's at once (`expert` None, `loaded` stacked `[experts, ...]`, as transformers 5 holds them)."""
        if part not in EXPERT_PARTS:
            raise ValueError(f"an expert has no {part!r} matrix (it has {', '.join(EXPERT_PARTS)})")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert}: the layer has {self.num_experts} experts")
        experts = slice(None) if expert is None else expert
        first = self.shard.rank * self.width
        if part == "down":
            self.w2[experts].copy_(loaded.narrow(-1, first, self.width))
        else:
            rows = slice(0, self.width) if part == "gate" else slice(self.width, 2 * self.width)
            self.w13[experts, rows].copy_(loaded.narrow(-2, first, self.width))
        done = range(self.num_experts) if expert is None else (expert,)
        self._loaded({(e, part) for e in done})

    @torch.no_grad()
    def _pack(self) -> None:
        """Into the dense linears' CPU layout, where the kernels' loop over experts can be had (else grouped_mm)."""
        pack = cpu_pack(self.w13)
        if pack is None:
            return
        self.kernel = "onednn" if pack is onednn_pack else "blocked"
        # Expert by expert; the stacked tensors are then freed (the plain and packed experts of one layer coexist).
        self.packed13 = tuple(pack(self.w13[expert]) for expert in range(self.num_experts))
        self.packed2 = tuple(pack(self.w2[expert]) for expert in range(self.num_experts))
        del self.w13, self.w2

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, top_k] float32
        ids: torch.Tensor,  # [T, top_k]
    ) -> torch.Tensor:  # [T, hidden]: this rank's partial sums with tensor parallelism
        if self.packed13 is None and x.is_cuda and x.dtype != torch.bfloat16:
            return every_expert(x, self.w13, self.w2, weights, ids)
        order, counts = group_by_expert(ids, self.num_experts)
        pairs = x[order // ids.shape[1]]  # [T * top_k, hidden]
        if self.packed13 is not None and self.packed2 is not None:
            out = torch.ops.ferry_kernels.experts(
                pairs, counts, self.packed13, self.packed2, self.width, SILU_KERNEL_MAX_TOKENS, [], [], 0.0, 0.0
            )
        else:
            offsets = counts.cumsum(0, dtype=torch.int32)  # [experts]: where each expert's pairs end
            gate_up = F.grouped_mm(pairs, self.w13.transpose(1, 2), offs=offsets)  # [T * top_k, 2 * width]
            gate, up = gate_up.split(self.width, dim=-1)
            out = F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offsets)  # [T * top_k, hidden]
        return mix_back(out, order, weights, x.dtype)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, width={self.width}, {self.kernel}, rank={self.shard.rank}/{self.shard.size}"
        )


def every_expert(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [experts, 2 * width, hidden]
    w2: torch.Tensor,  # [experts, hidden, width]
    weights: torch.Tensor,  # [T, top_k] float32
    ids: torch.Tensor,  # [T, top_k]
) -> torch.Tensor:  # [T, hidden]
    """SiLU-gated experts, every token through every one (`_every_expert`)."""
    width = w2.shape[-1]

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w13[index]).split(width, dim=-1)
        return F.linear(F.silu(gate) * up, w2[index])

    return _every_expert(x, weights, ids, w13.shape[0], expert)


def cpu_pack(weights: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How to pack one expert's `[out, in]` matrix of `weights`' dtype and device for the CPU kernels' loop over
    experts: the layout the model's dense linears take (`select_linear_method`), the blocked kernel's or oneDNN's
    packed one, or None where that loop cannot be had."""
    if weights.device.type != "cpu" or not cpu_kernels_available():
        return None
    method = select_linear_method(weights.device, weights.dtype)
    if isinstance(method, BlockedLinearMethod):
        from engine.kernels.linear import pack

        return pack
    return onednn_pack if isinstance(method, PackedLinearMethod) else None


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`[out, in]` in oneDNN's packed layout, for `torch.ops.mkldnn._linear_pointwise` (PackedLinearMethod's)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)


SILU_KERNEL_MAX_TOKENS = 16
"""Up to this many rows an expert, SiLU-and-multiply is one kernel call (the dense MLP's rule in
engine/models/llama.py)."""


class ClampedSwigluExperts(PackedOnLoad):
    """gpt-oss's experts: biased, gate and up interleaved in one matrix (`gate_up_proj` `[experts, hidden, 2 * width]`,
    even columns the gates), SwiGLU with the gate clamped above at `limit`, the up clamped to +-`limit`, and
    `(up + 1) * gate * sigmoid(alpha * gate)`, as transformers' `GptOssExperts` computes it. On a CPU each expert is
    packed like `FusedExperts`' and run by the same C++ op (with its biases and this activation); elsewhere one
    grouped matmul per matrix over the step's pairs sorted by expert (their biases gathered per pair).

    With tensor parallelism a rank holds a contiguous run of each expert's (gate, up) column pairs and the matching
    rows of `down`; the down bias is added by rank 0 only (the others hold zeros), so the all-reduce adds it once."""

    def __init__(
        self, num_experts: int, hidden: int, width: int, alpha: float, limit: float, shard: Shard = ONE_RANK
    ) -> None:
        super().__init__({"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"})
        if width % shard.size:
            raise ValueError(f"expert width {width} does not divide by {shard.size} tensor-parallel ranks")
        self.num_experts = num_experts
        self.width = width // shard.size
        self.alpha, self.limit = alpha, limit
        self.shard = shard
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * self.width), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * self.width), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, self.width, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.packed13: tuple[torch.Tensor, ...] | None = None
        self.packed2: tuple[torch.Tensor, ...] | None = None
        """On a CPU, each expert's matrices `[out, in]` in the dense linears' layout (as `FusedExperts` packs them)."""
        self.biases: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        """With them, each expert's gate/up and down biases (views of the parameters)."""

    @torch.no_grad()
    def _pack(self) -> None:
        """Into the dense linears' CPU layout, where the kernels' loop over experts can be had (else grouped_mm)."""
        pack = cpu_pack(self.gate_up_proj)
        if pack is None:
            return
        experts = range(self.num_experts)
        self.packed13 = tuple(pack(self.gate_up_proj[e].t().contiguous()) for e in experts)
        self.packed2 = tuple(pack(self.down_proj[e].t().contiguous()) for e in experts)
        self.biases = (
            tuple(self.gate_up_proj_bias[e] for e in experts),
            tuple(self.down_proj_bias[e] for e in experts),
        )
        del self.gate_up_proj, self.down_proj

    @torch.no_grad()
    def weight_loader(self, name: str, loaded: torch.Tensor) -> None:
        """This rank's slice of the checkpoint's `gate_up_proj`, `gate_up_proj_bias`, `down_proj` or
        `down_proj_bias` (all experts stacked, transformers' layout and names)."""
        first = self.shard.rank * self.width
        if name in ("gate_up_proj", "gate_up_proj_bias"):  # columns: this rank's (gate, up) pairs
            loaded = loaded.narrow(-1, 2 * first, 2 * self.width)
        elif name == "down_proj":
            loaded = loaded.narrow(1, first, self.width)
        elif name == "down_proj_bias":
            loaded = loaded if self.shard.rank == 0 else torch.zeros_like(loaded)
        else:
            raise ValueError(f"gpt-oss's experts have no {name!r}")
        self.get_parameter(name).copy_(loaded)
        self._loaded({name})

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        weights: torch.Tensor,  # [T, top_k] float32
        ids: torch.Tensor,  # [T, top_k]
    ) -> torch.Tensor:  # [T, hidden]: this rank's partial sums with tensor parallelism
        if self.packed13 is not None and self.packed2 is not None:
            order, counts = group_by_expert(ids, self.num_experts)
            out = torch.ops.ferry_kernels.experts(
                x[order // ids.shape[1]], counts, self.packed13, self.packed2, self.width, 0, *self.biases,
                self.alpha, self.limit,
            )  # fmt: skip
            return mix_back(out, order, weights, x.dtype)
        return torch.ops.ferry.clamped_swiglu_experts(
            x, weights, ids, self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias,
            self.alpha, self.limit, x.is_cuda and x.dtype != torch.bfloat16,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, width={self.width}, rank={self.shard.rank}/{self.shard.size}"


def _clamped_swiglu(projected: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`[rows, 2 * width]` (gates in the even columns) -> `[rows, width]`, as transformers' `GptOssExperts`."""
    gate = projected[:, 0::2].clamp(max=limit)
    up = projected[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_swiglu_experts(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, top_k] float32
    ids: torch.Tensor,  # [T, top_k]
    gate_up: torch.Tensor,  # [experts, hidden, 2 * width], gates in the even columns
    gate_up_bias: torch.Tensor,  # [experts, 2 * width]
    down: torch.Tensor,  # [experts, width, hidden]
    down_bias: torch.Tensor,  # [experts, hidden]
    alpha: float,
    limit: float,
    every_expert: bool = False,
) -> torch.Tensor:  # [T, hidden]
    """The routed pairs sorted by expert through grouped_mm; or, `every_expert` (CUDA in a dtype other than bfloat16,
    which grouped_mm takes there), every token through every expert weighted by its routing (zero where not routed)."""
    if every_expert:

        def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
            act = _clamped_swiglu(rows @ gate_up[index] + gate_up_bias[index], alpha, limit)
            return act @ down[index] + down_bias[index]

        return _every_expert(x, weights, ids, gate_up.shape[0], expert)
    order, counts = group_by_expert(ids, gate_up.shape[0])
    experts = ids.flatten()[order]  # [P]: each sorted pair's expert
    offsets = counts.cumsum(0, dtype=torch.int32)
    pairs = x[order // ids.shape[1]]  # [P, hidden]
    act = _clamped_swiglu(F.grouped_mm(pairs, gate_up, offs=offsets) + gate_up_bias[experts], alpha, limit)
    out = F.grouped_mm(act, down, offs=offsets) + down_bias[experts]  # [P, hidden]
    return mix_back(out, order, weights, x.dtype)


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
# One op to a compiler: grouped_mm's shape function takes bfloat16 alone (CUDA's constraint), while the CPU runs it
# in any float dtype.
_LIBRARY.define(
    "clamped_swiglu_experts(Tensor x, Tensor weights, Tensor ids, Tensor gate_up, Tensor gate_up_bias, Tensor down, "
    "Tensor down_bias, float alpha, float limit, bool every_expert) -> Tensor"
)
_LIBRARY.impl("clamped_swiglu_experts", clamped_swiglu_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::clamped_swiglu_experts", lib=_LIBRARY)
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape)
