"""GPU paged attention as one Triton kernel launch per layer, reading K/V pages in place at any page size.

The kernel takes the step's device metadata as the runner builds it: `query_start_loc` (int32 [B + 1]),
`seq_lens` (int32 [B]) and the page tables (int32 [B, max_pages], read through both strides, so a column slice
of a wider buffer is read as it lies). Nothing about the step is read on the host: the grid's size depends on
the number of tokens T, of sequences B and of KV heads only, so a launch can be captured in a CUDA graph and
replayed over the same buffers with other contents (padded decode rows, seq_len 1 over a scratch page, are one
more sequence to the kernel).

Grid and blocks. A program serves one block of a sequence's queries for one KV head: its rows are the block's
query tokens times the query heads sharing that KV head (row r is token r // GROUP, head kv_head * GROUP +
r % GROUP), so each key and value tile read from the cache serves the whole grouped-query group at once. Keys
are visited BLOCK_N at a time through the page table, one table entry per key, so a tile may span pages (page
size 8) or lie inside one (page size 256) alike; scores, the online softmax and the weighted sum of values are
float32 whatever the cache's dtype, the products run on tensor cores (`tl.dot`: bfloat16 and float16 as they
are, float32 in full IEEE precision, not TF32, so that it matches the other backends to ~1e-5).

- A decode-only step (T == B: every sequence brings one query, which the shapes alone tell) launches B x Hkv
  programs of one token each: program (b, h) reads sequence b's pages once for all of KV head h's query heads,
  BLOCK_M = max(16, GROUP) rows (`tl.dot` wants at least 16).
- Any other step launches (T // BLOCK_Q + B) x Hkv programs of BLOCK_Q = BLOCK_M // GROUP tokens: sequence s
  owns the programs from `query_start_loc[s] // BLOCK_Q + s` on, enough for its ceil(n_s / BLOCK_Q) blocks
  whatever its alignment, and the sum over sequences stays within that bound. Each program finds its sequence
  by a binary search over `query_start_loc` on the device (log2 B scalar loads, cheap beside one key tile), and
  programs past their sequence's last block exit at once. A grid of B x ceil(max_query_len / BLOCK_Q) with
  early exits would need the step's longest chunk on the host and waste most programs when one prompt is long
  and the rest are decodes; this one is exact within B programs and depends on shapes only.

A program attends to keys from its first query's window start (0 without a sliding window) up to its last
query's position: causal and window masks are per score, so rows of the same block see different prefixes.
Keys outside that range, pages a window released (the table may say -1 there) and padding columns are never
loaded. Soft-capping and ALiBi are applied in the torch backend's order: scale, soft-cap, bias. With non-causal
spans (`USE_SPANS`, the metadata's `token_spans`) each row's keys are its own interval `[lo, hi)`
(engine/attention/base.py), and the program visits the union of its rows' intervals. Sinks add one logit per
query head to the denominator at the end. A cache of another dtype than the queries' is converted to theirs as
each tile is loaded; its scales fold into the score's scale and the output's normalisation. A float8 e4m3 cache
(`--kv-cache-dtype fp8`) widens exactly to any of the three query dtypes (3 mantissa bits, exponents -9 to 8), so the
products keep running on tensor cores in the query's dtype; Triton converts e4m3 (`fp8e4nv`) on compute capability
8.9 and up only (Ada, Hopper), so below it the backend declares no float8 cache and `auto` takes the torch backend.

Triton settles whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`, numpy on CPU tensors) when this
module is imported, for its own library functions when triton is first imported: tests/conftest.py turns the
interpreter on before either, where there is no CUDA device.

Long decodes run one program per (sequence, KV head) over all of their keys; a step of few, very long decodes
would gain from splitting keys across programs (flash-decoding), which this kernel does not do.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import triton
import triton.language as tl

from engine.attention.base import AttentionBackend, AttentionFeature, AttentionNeeds, StepMetadata, is_float8, write_kv

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PREFILL_ROWS = 64
"""Rows (query tokens x grouped heads) of a program in a step with prefill chunks: each key tile is reused by
that many rows, and a causal block wastes at most one tile's worth of masked scores per row."""
_BLOCK_N = 32
"""Keys per tile."""


# The batch size changes every step: specialising on it (Triton does for 1 and multiples of 16) would compile
# new variants mid-serving, a second each.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_pages, page_size, Hkv, D]
    value_cache_ptr,  # [num_pages, page_size, Hkv, D]
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    page_tables_ptr,  # [B, max_pages] int32
    alibi_slopes_ptr,  # [H] float32 (unread without ALiBi)
    sinks_ptr,  # [H] float32 (unread without sinks)
    token_spans_ptr,  # [T, 2] int32 (unread without spans)
    num_seqs,
    scale,  # times k_scale: the cache holds keys / k_scale
    v_scale,  # the cache holds values / v_scale
    softcap,
    window,  # 0: no sliding window
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_table_row,
    stride_table_col,
    page_size,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    DECODE: tl.constexpr,  # every sequence has one query: program b is sequence b
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SPANS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tl.program_id(0)
        block = 0
    else:
        # The last sequence whose first program is at or before this one.
        pid = tl.program_id(0)
        lo = tl.zeros((), dtype=tl.int32)
        hi = tl.zeros((), dtype=tl.int32) + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            first_program = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first_program <= pid, mid, lo)
            hi = tl.where(first_program <= pid, hi, mid)
        seq = lo
        block = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)

    query_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if block * BLOCK_Q >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    token = block * BLOCK_Q + rows // GROUP  # [BLOCK_M] index among the sequence's queries
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (token < num_queries)
    query_pos = seq_len - num_queries + token  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    q_offsets = (query_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if USE_ALIBI:
        slopes = tl.load(alibi_slopes_ptr + head, mask=row_valid, other=0.0)  # [BLOCK_M]

    first_pos = seq_len - num_queries + block * BLOCK_Q
    key_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the block's last query position
    key_start = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    row_lo = tl.where(window > 0, tl.maximum(query_pos - window + 1, 0), 0)  # [BLOCK_M] keys [lo, hi) per row
    row_hi = query_pos + 1
    if USE_SPANS:
        span_offsets = (query_start + token) * 2
        span_start = tl.load(token_spans_ptr + span_offsets, mask=row_valid, other=0)
        span_end = tl.load(token_spans_ptr + span_offsets + 1, mask=row_valid, other=0)
        in_span = span_start < span_end
        row_lo = tl.where(in_span, span_start, row_lo)  # the interval the runner computed for the layer
        row_hi = tl.where(in_span, span_end, row_hi)
        key_start = tl.min(tl.where(row_valid, row_lo, seq_len), axis=0)
        key_end = tl.max(tl.where(row_valid, row_hi, 0), axis=0)

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running maximum, log2 units
    lse = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running sum of exponentials
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table_row = page_tables_ptr + seq * stride_table_row
    cols = tl.arange(0, BLOCK_N)
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_pos = tile_start + cols  # [BLOCK_N]
        key_valid = key_pos < key_end
        page = tl.load(table_row + (key_pos // page_size) * stride_table_col, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % page_size
        k_offsets = page * stride_kp + slot * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_offsets = page * stride_vp + slot * stride_vs + kv_head * stride_vh  # [BLOCK_N]
        k = tl.load(
            key_cache_ptr + k_offsets[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if USE_SOFTCAP:
            # softcap * tanh(scores / softcap), tanh written with exp (core tl has none); it saturates to +-1.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        if USE_ALIBI:
            scores += slopes[:, None] * (key_pos[None, :] - query_pos[:, None]).to(tl.float32)
        visible = row_valid[:, None] & key_valid[None, :]
        visible &= (key_pos[None, :] >= row_lo[:, None]) & (key_pos[None, :] < row_hi[:, None])
        # In log2 units from here on (times log2(e)): exp2 is the hardware's instruction, exp is not.
        scores = tl.where(visible, scores * 1.4426950408889634, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # A row with no visible key so far stays at -inf: subtract 0 instead, so that no -inf - -inf NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        lse = lse * alpha + tl.sum(p, axis=1)
        v = tl.load(
            value_cache_ptr + v_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    if USE_SINKS:
        sinks = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
        lse += tl.exp2(sinks - tl.where(m == float("-inf"), 0.0, m))
    out = acc * v_scale / tl.where(lse == 0.0, 1.0, lse)[:, None]
    o_offsets = (query_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    # A latent head (576 wide, BLOCK_D 1024) has never run on a GPU here: `auto` leaves MLA to the torch backend.
    features = frozenset(AttentionFeature) - {AttentionFeature.LATENT}
    kv_cache_dtypes: ClassVar[dict[torch.dtype, frozenset[torch.dtype]]] = {
        model: frozenset({*TRITON_DTYPES, torch.float8_e4m3fn}) - {model} for model in TRITON_DTYPES
    }
    capturable = True
    """One launch per layer whose grid depends on tensor shapes only, over device metadata only."""

    @classmethod
    def missing(cls, needs: AttentionNeeds, dtype: torch.dtype) -> list[str]:
        lacking = super().missing(needs, dtype)
        float8 = needs.kv_cache_dtype is not None and is_float8(needs.kv_cache_dtype)
        # Without a CUDA device the kernel is interpreted, which converts e4m3 on the CPU.
        if float8 and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            lacking.append("a float8 KV cache below compute capability 8.9 (Triton converts e4m3 on Ada and Hopper)")
        return lacking

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: StepMetadata,
        scale: float,
        sliding_window: int | None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        k_cache, v_cache = kv_cache
        # The kernel steps through the head dimension with unit stride (vector loads); projections' views have it.
        query = query if query.stride(-1) == 1 else query.contiguous()
        tokens, heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        num_seqs = meta.seq_lens.shape[0]
        decode = tokens == num_seqs
        block_m = max(16 if decode else _PREFILL_ROWS, triton.next_power_of_2(group))
        block_q = 1 if decode else block_m // group
        programs = num_seqs if decode else tokens // block_q + num_seqs
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D], unit stride in D
        tables = meta.page_tables
        _paged_attention_kernel[(programs, kv_heads)](
            out,
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            tables,
            query if alibi_slopes is None else alibi_slopes,
            query if sinks is None else sinks,
            tables if meta.token_spans is None else meta.token_spans,
            num_seqs,
            scale * k_scale,
            v_scale,
            softcap or 0.0,
            sliding_window or 0,
            out.stride(0),
            out.stride(1),
            query.stride(0),
            query.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            tables.stride(0),
            tables.stride(1),
            meta.page_size,
            head_dim,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=_BLOCK_N,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            DECODE=decode,
            USE_SOFTCAP=softcap is not None,
            USE_ALIBI=alibi_slopes is not None,
            USE_SINKS=sinks is not None,
            USE_SPANS=meta.token_spans is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        )
        return out
