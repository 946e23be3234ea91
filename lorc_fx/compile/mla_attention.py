"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and their descendants) read absorbed.

MLA caches one normalised latent ``c`` ``(b, 1, n, r)`` and one RoPE key ``k_r`` ``(b, 1, n,
d_r)`` shared by every head; each step the model expands the latent by its up-projection
``W`` (``kv_b_proj``, rows ``(h, d_n + d_v)``): head ``i``'s key is ``cat(W_k,i c, k_r)`` and
its value ``W_v,i c``, a ``(b, h, n, d_n + d_r)`` and a ``(b, h, n, d_v)`` tensor built from the
whole cache every step. With the query ``cat(q_n, q_r)`` (``d_n + d_r`` wide)::

    q·k = (W_k,iᵀ q_n)·c + q_r·k_r        out_i = W_v,i (Σ p c)

so attention becomes multi-query attention over ``cat(c, k_r)`` with the value ``c``, the
up-projection moved onto the query and the output: the absorption DeepSeek's own inference
code uses. Exact (the same sums in another order); per step it costs ``h·(d_n + d_v)·r``
multiply-adds a query token instead of ``n·r·h·(d_n + d_v)`` for the expansion.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_attention(query, latent, rope_key, up_weight, nope_dim: int, attn_mask=None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  heads_as_rows: bool = False):
    """SDPA of ``query`` ``(b, h, t, d_n + d_r)`` over the keys and values MLA expands from
    ``latent`` ``(b, 1, n, r)`` and ``rope_key`` ``(b, 1, n, d_r)`` by ``up_weight``
    ``(h·(d_n + d_v), r)``, ``d_n = nope_dim``; returns ``(b, h, t, d_v)``.

    ``heads_as_rows`` (for a few query tokens: decode steps) reads the heads as ``h·t`` query
    rows of one head, the mask expanded to match: CPU SDPA with ``enable_gqa`` copies the
    latent once per head (measured: 370 ms against 7 for one token of 16 heads over 8192
    slots, one thread), and the expanded mask is ``h·t·n``, small only while ``t`` is.
    """
    b, h, t, _ = query.shape
    n, r = latent.shape[-2:]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    per_head = up_weight.view(h, -1, r)  # (h, d_n + d_v, r)
    q_latent = torch.einsum("bhtd,hdr->bhtr", query[..., :nope_dim], per_head[:, :nope_dim])
    query = torch.cat((q_latent, query[..., nope_dim:]), dim=-1)
    key = torch.cat((latent, rope_key), dim=-1)
    if heads_as_rows:
        if is_causal:  # SDPA's own: query row i sees keys 0..i
            attn_mask = torch.ones(t, n, dtype=torch.bool, device=query.device).tril()
        if attn_mask is not None:
            attn_mask = attn_mask.expand(b, h, t, n).reshape(b, 1, h * t, n)
        out = F.scaled_dot_product_attention(
            query.reshape(b, 1, h * t, -1), key, latent, attn_mask=attn_mask,
            dropout_p=dropout_p, scale=scale).view(b, h, t, r)
    else:
        out = F.scaled_dot_product_attention(
            query, key, latent, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=True)
    return torch.einsum("bhtr,hvr->bhtv", out, per_head[:, nope_dim:])
