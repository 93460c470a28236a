"""Multi-head latent attention (MLA: DeepSeek V2/V3, GLM-4.7-Flash) over a latent cache, in two forms.

Each token's keys and values are compressed into one latent `c` of `kv_lora_rank` (normed) plus a rotary key part
`k_pe` shared by every head; head h's key is `[W_UK[h] c, k_pe]` and its value `W_UV[h] c`. The cache keeps
`[c, k_pe]` only (`LatentAttentionSpec`).

- **Absorbed** (decodes, chunks over cached pages): W_UK is absorbed into the query (`q_nope W_UK[h]`, a
  `[kv_lora_rank]` vector per head), so head h's score against a token is `[q_nope W_UK[h], q_pe] . [c, k_pe]`,
  and W_UV is applied after the softmax to the mix of latents. That is attention of every query head over one KV
  head `[c, k_pe]` whose values are its own first `kv_lora_rank` columns: the step's backend computes it as
  multi-query attention with the latent pages passed as both K and V (the value's extra rotary columns come out of
  the mix and are dropped). It reads each cached token once for all heads, which is what decode is bound by.
- **Expanded** (fresh prompts of `DENSE_PROMPT_TOKENS` and more: every key computed in this step): the prompt's
  latents become per-head keys `[W_UK[h] c, k_pe]` and values `W_UV[h] c` (one matrix product each, the same cost
  as the absorbed form's query and output products), and torch's causal SDPA attends heads of `nope + rope` and
  `v_head_dim` (192 and 128 for V2-Lite/V3) instead of the latent's 576 and 512: a third of the score and mix
  products, on the CPU's matrix units where it has them. transformers computes this form.

Both give one output; the step's prompts take the second where the cache holds the model's own dtype (a float8
cache's prompts stay absorbed, so that every query reads the keys as stored) and no non-causal span is entered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, StepMetadata, dense_attention, write_kv
from engine.attention.context import current_step
from engine.attention.prompt_split import prompt_split


def latent_attention(
    q_nope: torch.Tensor,  # [T, h, nope]
    q_pe: torch.Tensor,  # [T, h, rope], rotated
    latent: torch.Tensor,  # [T, kv_lora_rank], normed
    k_pe: torch.Tensor,  # [T, 1, rope], rotated
    w_uk: torch.Tensor,  # [h, nope, kv_lora_rank]
    w_uv: torch.Tensor,  # [h, v, kv_lora_rank]
    cache: torch.Tensor,  # [pages, page_size, 1, kv_lora_rank + rope]: a latent layer's K and V pages
    scale: float,
) -> torch.Tensor:  # [T, h, v]
    """Write the step's latents and rotary keys into `cache` and attend, through the active step's backend (and
    torch's SDPA for its fresh prompts). A compiled graph holds this as the opaque op `ferry::latent_attention`,
    which runs this function (as `ferry::layer_attention` runs paged attention: engine/attention/graph_op.py)."""
    if torch.compiler.is_compiling():
        return torch.ops.ferry.latent_attention(q_nope, q_pe, latent, k_pe, w_uk, w_uv, cache, scale)
    step = current_step()
    meta = step.by_window[None]
    key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, latent + rope]
    split = None
    if meta.token_spans is None and cache.dtype == latent.dtype:
        split = prompt_split(meta, step.backend)
    if split is None or not split.prompts:
        return _absorbed(q_nope, q_pe, key, w_uk, w_uv, cache, meta, scale, step.backend)
    prompt_key = key.index_select(0, split.prompt_rows)
    write_kv(prompt_key, prompt_key, (cache, cache), meta.slot_mapping.index_select(0, split.prompt_rows))
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for first, end in split.prompts:
        out[first:end] = _expanded(
            q_nope[first:end], q_pe[first:end], latent[first:end], k_pe[first:end], w_uk, w_uv, scale
        )
    if split.rest is not None:
        rows = split.rest_rows
        out[rows] = _absorbed(q_nope[rows], q_pe[rows], key[rows], w_uk, w_uv, cache, split.rest, scale, step.backend)
    return out


def _absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    key: torch.Tensor,  # [T, 1, latent + rope]
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor,
    meta: StepMetadata,
    scale: float,
    backend: AttentionBackend,
) -> torch.Tensor:  # [T, h, v]
    latent = w_uk.shape[2]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, latent]
    query = torch.cat([q_latent, q_pe], dim=-1)  # [T, h, latent + rope]
    # The latent pages are the keys and the values (their first `latent` columns): one tensor passed twice.
    mixed = backend.forward(query, key, key, (cache, cache), meta, scale, None)  # [T, h, latent + rope]
    out = torch.bmm(mixed[..., :latent].transpose(0, 1), w_uv.transpose(1, 2))  # [h, T, v]
    return out.transpose(0, 1).contiguous()  # the layout the op declares (its fake's)


def _expanded(
    q_nope: torch.Tensor,  # [L, h, nope]
    q_pe: torch.Tensor,  # [L, h, rope]
    latent: torch.Tensor,  # [L, latent]
    k_pe: torch.Tensor,  # [L, 1, rope]
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [L, h, v]
    """One fresh prompt's causal attention with its heads' keys and values expanded from its latents."""
    tokens, heads, nope = q_nope.shape
    k_nope = (latent @ w_uk.reshape(heads * nope, -1).t()).view(tokens, heads, nope)
    value = (latent @ w_uv.reshape(heads * w_uv.shape[1], -1).t()).view(tokens, heads, -1)
    query = torch.cat([q_nope, q_pe], dim=-1)  # [L, h, nope + rope]
    key = torch.cat([k_nope, k_pe.expand(tokens, heads, -1)], dim=-1)
    v_dim = value.shape[-1]
    # Values narrower than the keys leave SDPA's fused CPU kernel for its op-by-op path (5x slower at a 388-token
    # prompt of 16 heads, 192/128): zero columns make them as wide, and come out of the mix as zeros.
    value = F.pad(value, (0, max(0, query.shape[-1] - v_dim)))
    return dense_attention(query, key, value, scale, causal=True)[..., :v_dim]


_LIBRARY = torch.library.Library("ferry", "FRAGMENT")
_LIBRARY.define(
    "latent_attention(Tensor q_nope, Tensor q_pe, Tensor latent, Tensor k_pe, Tensor w_uk, Tensor w_uv, "
    "Tensor(a!) cache, float scale) -> Tensor"
)
_LIBRARY.impl("latent_attention", latent_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("ferry::latent_attention", lib=_LIBRARY)
def _(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
