"""Attention over a latent cache with the bases folded into query and output (absorbed form).

Query head ``i`` reads kv head ``g(i) = i // (h / h_kv)``. With ``B_j`` the ``(r, d)`` block
of basis columns of kv head ``j``, ``q·kᵀ = (B_g q)·c`` and the head output is
``B_gᵀ (Σ p c_v)``: attention becomes multi-query attention over the latent.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def head_blocks(basis: torch.Tensor, num_kv_heads: int, num_heads: int) -> torch.Tensor:
    """``(r, h_kv*d)`` basis → ``(h, r, d)``: the block each query head reads."""
    r = basis.shape[0]
    blocks = basis.view(r, num_kv_heads, -1).transpose(0, 1)
    return blocks.repeat_interleave(num_heads // num_kv_heads, dim=0)


def latent_attention(query, k_latent, v_latent, k_basis, v_basis, num_kv_heads: int,
                     attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None):
    """SDPA of ``query (b, h, t, d)`` over latents ``(b, 1, n, r)``; returns ``(b, h, t, d)``."""
    h, d = query.shape[1], query.shape[-1]
    q_latent = torch.einsum("bhtd,hrd->bhtr", query, head_blocks(k_basis, num_kv_heads, h))
    out = F.scaled_dot_product_attention(
        q_latent, k_latent, v_latent, attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=d ** -0.5 if scale is None else scale, enable_gqa=True)
    return torch.einsum("bhtr,hrd->bhtd", out, head_blocks(v_basis, num_kv_heads, h))
