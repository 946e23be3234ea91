"""Attention over a latent cache with the bases folded into query and output (absorbed form).

Query head ``i`` reads kv head ``g(i) = i // (h / h_kv)``. With ``B_j`` the ``(r, d)`` block
of basis columns of kv head ``j``, ``q·kᵀ = (B_g q)·c`` and the head output is
``B_gᵀ (Σ p c_v)``: attention becomes multi-query attention over the latent. One-token
decode steps on CUDA go to the Triton kernel ``lorc::latent_decode`` (reads each latent
tile once for all heads); everything else to ``scaled_dot_product_attention``.

Keys cached before RoPE (``reconstruct`` mode) cannot be absorbed whole: the rotation of each
position sits between the basis and the query. :func:`rotary_latent_attention` rebuilds them
(``N·r_k·h_kv·d`` multiply-adds a step, the mode's price) and reads the values absorbed; no
``(b, h, n, d)`` copy of keys or values is made. Where each row of the key basis lies on one
rotary pair (a RoPE-commuting basis), the basis is absorbed per pair instead and the latent
is turned by its channels' angles (:func:`per_frequency_scores`: ``2·N·r_k`` products and
``2·N·r_k`` multiply-adds a query row, no key rebuilt).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lorc_fx.cache.rotary import pair_dims, per_pair, rotate_by
from lorc_fx.kernels.ops import triton_available


def head_blocks(basis: torch.Tensor, num_kv_heads: int, num_heads: int) -> torch.Tensor:
    """``(r, h_kv*d)`` basis → ``(h, r, d)``: the block each query head reads."""
    r = basis.shape[0]
    blocks = basis.view(r, num_kv_heads, basis.shape[1] // num_kv_heads).transpose(0, 1)
    return blocks.repeat_interleave(num_heads // num_kv_heads, dim=0)


def _kernel_mask(attn_mask, batch: int, length: int) -> torch.Tensor | None:
    """A boolean ``(b, 1, 1, n)`` mask as the kernel's ``(b, n)``; None when there is none."""
    return None if attn_mask is None else attn_mask.expand(batch, 1, 1, length)[:, 0, 0]


def decode_kernel_applies(query, attn_mask, dropout_p: float) -> bool:
    """One query token, no dropout, a boolean mask or none, on CUDA with Triton."""
    mask_ok = attn_mask is None or (attn_mask.dtype == torch.bool and attn_mask.shape[-2] == 1)
    return (query.is_cuda and triton_available() and query.shape[2] == 1 and dropout_p == 0.0
            and mask_ok)


def multi_query_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     heads_as_rows: bool = False):
    """SDPA of ``query (b, h, t, d)`` over one key and value head ``(b, 1, n, ·)`` shared by
    every query head; returns ``(b, h, t, d_v)``.

    ``heads_as_rows`` (for a few query tokens: decode steps) reads the heads as ``h·t`` query
    rows of one head, the mask expanded to match: CPU SDPA with ``enable_gqa`` copies the shared
    head once per query head (measured, one thread, one token over 4096 slots: 1.12 ms against
    0.34 compiled for 9 heads of a 96-wide latent; 370 ms against 7 eager for 16 heads of MLA's
    576-wide one over 8192), and the expanded mask is ``h·t·n``, small only while ``t`` is.
    """
    if not heads_as_rows:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    b, h, t, _ = query.shape
    n = key.shape[-2]
    if is_causal:  # SDPA's own: query row i sees keys 0..i
        attn_mask = torch.ones(t, n, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        attn_mask = attn_mask.expand(b, h, t, n).reshape(b, 1, h * t, n)
    out = F.scaled_dot_product_attention(query.reshape(b, 1, h * t, -1), key, value,
                                         attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    return out.view(b, h, t, -1)


def latent_attention(query, k_latent, v_latent, k_basis, v_basis, num_kv_heads: int,
                     attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, use_kernel: bool | None = None,
                     heads_as_rows: bool = False):
    """SDPA of ``query (b, h, t, d)`` over latents ``(b, 1, n, r)``; returns ``(b, h, t, d)``.

    ``use_kernel``: None picks the decode kernel where :func:`decode_kernel_applies`;
    ``heads_as_rows`` as :func:`multi_query_sdpa`.
    """
    b, h, t, d = query.shape
    scale = d ** -0.5 if scale is None else scale
    q_latent = torch.einsum("bhtd,hrd->bhtr", query, head_blocks(k_basis, num_kv_heads, h))
    if use_kernel is None:
        use_kernel = decode_kernel_applies(query, attn_mask, dropout_p)
    if use_kernel:
        mask = _kernel_mask(attn_mask, b, k_latent.shape[-2])
        out = torch.ops.lorc.latent_decode(q_latent[:, :, 0], k_latent, v_latent, scale,
                                           mask=mask).unsqueeze(2)
    else:
        out = multi_query_sdpa(q_latent, k_latent, v_latent, attn_mask, dropout_p, is_causal,
                               scale, heads_as_rows)
    return torch.einsum("bhtr,hrd->bhtd", out, head_blocks(v_basis, num_kv_heads, h))


def rotary_latent_attention(query, k_latent, cos, sin, v_latent, k_basis, v_basis,
                            num_kv_heads: int, style: str, pairs=None, attn_mask=None,
                            scale: float | None = None):
    """SDPA of a few query tokens ``(b, h, t, d)`` over a pre-RoPE key latent rotated by
    ``cos``/``sin`` ``(b, n, rotary_dim)`` and a value latent ``(b, 1, n, r_v)`` read absorbed;
    returns ``(b, h, t, d)``. Scores as :func:`pre_rope_scores`; a query row whose every key is
    masked gets zeros, as SDPA's math backend gives.
    """
    scores = pre_rope_scores(query, k_latent, cos, sin, k_basis, num_kv_heads, style, pairs,
                             scale)
    return latent_sums(masked_softmax(scores, attn_mask), v_latent, v_basis, num_kv_heads)


def one_side_latent_attention(query, keys, values, num_kv_heads: int, attn_mask=None,
                              scale: float | None = None):
    """SDPA of a few query tokens ``(b, h, t, d)`` where one side is a latent and the other
    is kept as it comes ``(b, h_kv, n, ·)`` (a plan that keeps keys behind a norm, or values
    behind one, in the model's dtype). ``keys``/``values``: ``("latent", latent, basis)``,
    ``("rotated", latent, basis, cos, sin, style, pairs)`` (keys cached before RoPE) or
    ``("kept", tensor)``. Scores are materialised: for decode steps."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    kind, *k = keys
    if kind == "latent":
        scores = latent_scores(query, k[0], k[1], num_kv_heads) * scale
    elif kind == "rotated":
        latent, basis, cos, sin, style, pairs = k
        scores = pre_rope_scores(query, latent, cos, sin, basis, num_kv_heads, style, pairs,
                                 scale)
    else:
        scores = rows_times(query, k[0].transpose(-1, -2), num_kv_heads) * scale
    probs = masked_softmax(scores, attn_mask)
    kind, *v = values
    if kind == "latent":
        return latent_sums(probs, v[0], v[1], num_kv_heads)
    return rows_times(probs, v[0], num_kv_heads)


def rows_times(x, other, groups: int = 1):
    """``x (b, h, t, ·)`` times ``other (b, groups, ·, ·)``: ``(b, h, t, ·)``, each query
    head's ``t`` rows read as rows of its group (one group: a latent's one head; ``h_kv``
    groups: each head's KV head), so ``other`` is never repeated per query head."""
    b, h, t, _ = x.shape
    return (x.reshape(b, groups, h // groups * t, -1) @ other).view(b, h, t, -1)


def latent_scores(query, k_latent, k_basis, num_kv_heads: int):
    """``query (b, h, t, d)`` times the keys rebuilt from ``k_latent (b, 1, n, r)``,
    transposed (manual attention's ``q @ kᵀ``, unscaled): ``(b, h, t, n)``, the basis folded
    into the query and the heads read as rows of the latent's one head."""
    q_latent = torch.einsum("bhtd,hrd->bhtr", query,
                            head_blocks(k_basis, num_kv_heads, query.shape[1]))
    return rows_times(q_latent, k_latent.transpose(-1, -2))


def latent_sums(probs, v_latent, v_basis, num_kv_heads: int):
    """Weights ``probs (b, h, t, n)`` times the values rebuilt from ``v_latent (b, 1, n, r)``
    (manual attention's ``p @ v``): ``(b, h, t, d)``, summed over the latent, then out
    through each head's block of the basis."""
    return torch.einsum("bhtr,hrd->bhtd", rows_times(probs, v_latent),
                        head_blocks(v_basis, num_kv_heads, probs.shape[1]))


def pre_rope_scores(query, k_latent, cos, sin, k_basis, num_kv_heads: int, style: str,
                    pairs=None, scale: float | None = None):
    """Scaled scores ``(b, h, t, n)`` over a pre-RoPE key latent: :func:`per_frequency_scores`
    where ``pairs`` gives each basis row's rotary pair, else :func:`rotary_scores`."""
    if pairs is not None:
        return per_frequency_scores(query, k_latent, cos, sin, k_basis, num_kv_heads, style,
                                    pairs, scale)
    return rotary_scores(query, k_latent, cos, sin, k_basis, num_kv_heads, style, scale)


def per_frequency_scores(query, k_latent, cos, sin, k_basis, num_kv_heads: int, style: str,
                         pairs, scale: float | None = None):
    """Scaled scores ``(b, h, t, n)`` of a few query tokens ``(b, h, t, d)`` against a
    pre-RoPE key latent ``(b, 1, n, r)`` whose basis row ``c`` lies on rotary pair
    ``f = pairs[c]`` (dims ``a``, ``b`` of each head: ``rotary.frequency_pairs``).

    RoPE turns pair ``f`` of a key by its position's angle: ``a' = a·cos - b·sin``,
    ``b' = b·cos + a·sin``, and ``(a, b)`` of the key rebuilt is ``Σ_c z_c·(B_ca, B_cb)`` over
    the channels on ``f``. So ``q·k' = Σ_c z_c·(cos_f·α_c + sin_f·β_c)`` with
    ``α_c = q_a·B_ca + q_b·B_cb`` and ``β_c = q_b·B_ca - q_a·B_cb``, per query row: one
    product of ``(z·cos, z·sin)`` with ``(α, β)``, no key rebuilt. Exact (the same sum as
    :func:`rotary_scores` in another order).
    """
    b, h, t, d = query.shape
    scale = d ** -0.5 if scale is None else scale
    z = k_latent.squeeze(1)  # (b, n, r)
    ab = per_frequency_queries(query, k_basis, num_kv_heads, style, pairs, cos.shape[-1])
    scores = ab.to(z.dtype) @ turned(z, cos, sin, style, pairs).transpose(1, 2)
    return scores.view(b, h, t, -1) * scale


def per_frequency_queries(query, k_basis, num_kv_heads: int, style: str, pairs,
                          rotary_dim: int):
    """``(α, β)`` of :func:`per_frequency_scores`, ``(b, h·t, 2r)``: each query row's
    weights of a latent's channels turned by their pairs' cosines, then by their sines."""
    b, h, t, _ = query.shape
    r = len(pairs)
    re, im = (torch.tensor([pair_dims(p, rotary_dim, style)[i] for p in pairs],
                           device=query.device) for i in (0, 1))
    channel = torch.arange(r, device=query.device)
    blocks = head_blocks(k_basis, num_kv_heads, h)  # (h, r, d)
    b_re, b_im = blocks[:, channel, re][:, None], blocks[:, channel, im][:, None]  # (h, 1, r)
    q_re, q_im = query[..., re], query[..., im]  # (b, h, t, r)
    return torch.cat((q_re * b_re + q_im * b_im, q_im * b_re - q_re * b_im),
                     dim=-1).reshape(b, h * t, 2 * r)


def turned(z, cos, sin, style: str, pairs):
    """``(z·cos, z·sin)`` ``(b, n, 2r)`` of latents ``z (b, n, r)``: each channel times its
    rotary pair's cosine, then its sine, at the token's angles ``cos``/``sin``
    ``(b, n, rotary_dim)``."""
    at = torch.tensor(pairs, device=z.device)
    return torch.cat((z * per_pair(cos, style)[..., at].to(z.dtype),
                      z * per_pair(sin, style)[..., at].to(z.dtype)), dim=-1)


def rotary_scores(query, k_latent, cos, sin, k_basis, num_kv_heads: int, style: str,
                  scale: float | None = None):
    """Scaled scores ``(b, h, t, n)`` of a few query tokens ``(b, h, t, d)`` against keys kept
    as a pre-RoPE latent ``(b, 1, n, r)`` and rotated by ``cos``/``sin`` ``(b, n, rotary_dim)``.

    ``q·R_n k_n = (R_nᵀ q)·k_n``: each key is rebuilt before RoPE, once per kv head, and scored
    against the queries of its group turned back by its position's angle. Written as one
    product-and-sum over the head dim, Inductor fuses the turn into the score reduction, so
    neither rotated keys nor turned queries are stored (measured on CPU: 1.1–1.7× faster than
    rotating the rebuilt keys and then multiplying). Scores are materialised: for decode
    steps, not prefill.
    """
    b, h, t, d = query.shape
    n, groups = k_latent.shape[-2], h // num_kv_heads * t
    scale = d ** -0.5 if scale is None else scale
    keys = (k_latent.squeeze(1) @ k_basis).view(b, n, num_kv_heads, 1, d).permute(0, 2, 3, 1, 4)
    turned = rotate_by(query.reshape(b, num_kv_heads, groups, 1, d), cos[:, None, None],
                       sin[:, None, None], style, inverse=True)  # (b, h_kv, g·t, n, d)
    # summed in the order of the scores' axes, so they come out laid out (b, h, t, n)
    return (keys * turned).sum(-1).reshape(b, h, t, n) * scale


def masked_softmax(scores, attn_mask=None):
    """Softmax over the last axis after SDPA's mask (boolean: True attends; floating: added);
    a row whose every key is masked gets zeros, as SDPA's math backend gives."""
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return torch._safe_softmax(scores, dim=-1)
