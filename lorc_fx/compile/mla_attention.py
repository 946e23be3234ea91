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
multiply-adds a query token instead of ``n·r·h·(d_n + d_v)`` for the expansion. Manual
attention (sink logits, softcaps between its two products) reads the same through
:func:`mla_scores` and :func:`mla_sums`.
"""
from __future__ import annotations

import torch

from .latent_attention import multi_query_sdpa, rows_times


def mla_attention(query, latent, rope_key, up_weight, nope_dim: int, attn_mask=None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  heads_as_rows: bool = False):
    """SDPA of ``query`` ``(b, h, t, d_n + d_r)`` over the keys and values MLA expands from
    ``latent`` ``(b, 1, n, r)`` and ``rope_key`` ``(b, 1, n, d_r)`` by ``up_weight``
    ``(h·(d_n + d_v), r)``, ``d_n = nope_dim``; returns ``(b, h, t, d_v)``. ``heads_as_rows``
    as ``latent_attention.multi_query_sdpa`` (for decode steps)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = multi_query_sdpa(_latent_query(query, up_weight, nope_dim),
                           torch.cat((latent, rope_key), dim=-1), latent, attn_mask, dropout_p,
                           is_causal, scale, heads_as_rows)
    return _head_outputs(out, up_weight, nope_dim)


def mla_scores(query, latent, rope_key, up_weight, nope_dim: int):
    """Manual attention's ``query @ key.transpose(2, 3)`` over the keys MLA expands, unscaled:
    ``(b, h, t, n)``, the heads read as query rows of the latent."""
    return rows_times(_latent_query(query, up_weight, nope_dim),
                      torch.cat((latent, rope_key), dim=-1).transpose(-1, -2))


def mla_sums(probs, latent, up_weight, nope_dim: int):
    """Manual attention's ``probs @ value`` over the values MLA expands: ``(b, h, t, d_v)``."""
    return _head_outputs(rows_times(probs, latent.to(probs.dtype)), up_weight, nope_dim)


def _per_head(up_weight, heads: int) -> torch.Tensor:
    """``W`` as ``(h, d_n + d_v, r)``: each head's rows."""
    return up_weight.view(heads, -1, up_weight.shape[-1])


def _latent_query(query, up_weight, nope_dim: int):
    """``cat(W_kᵀ q_n, q_r)`` ``(b, h, t, r + d_r)``: the query as the latent's keys meet it."""
    w_k = _per_head(up_weight, query.shape[1])[:, :nope_dim]
    q_latent = torch.einsum("bhtd,hdr->bhtr", query[..., :nope_dim], w_k)
    return torch.cat((q_latent, query[..., nope_dim:]), dim=-1)


def _head_outputs(out, up_weight, nope_dim: int):
    """Each head's weighted sum of latents ``(b, h, t, r)`` through its ``W_v``:
    ``(b, h, t, d_v)``."""
    w_v = _per_head(up_weight, out.shape[1])[:, nope_dim:]
    return torch.einsum("bhtr,hvr->bhtv", out, w_v)
