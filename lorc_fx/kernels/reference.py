"""The plain torch implementation of the decode attention op.

It defines what the Triton kernel computes: tests run it in float64, and the op falls back to
it (in float32) where Triton cannot run. Shapes follow :mod:`lorc_fx.kernels.ops`; queries here
are always 4-D ``(B, H, T, r)``.

Key visibility: key ``n`` of row ``b`` is visible when ``mask[b, n]`` (if given) and
``start[b] <= n < start[b] + length[b]`` (if given; ``start`` defaults to 0, ``length`` to
``N - start``). With ``T > 1`` query tokens, the queries are the last ``T`` visible positions
(bottom-right causal): query ``t`` also needs ``n <= end[b] - T + t``. A query with no visible key
outputs zeros.
"""
from __future__ import annotations

import torch


def key_visibility(batch: int, n: int, t: int, mask, start, length, device) -> torch.Tensor:
    """Boolean ``(B, 1, T, N)``: which keys each query token may attend to."""
    pos = torch.arange(n, device=device)
    start = torch.zeros(batch, dtype=torch.long, device=device) if start is None else start.long()
    end = n - start if length is None else length.long()
    end = start + end
    visible = (pos >= start[:, None]) & (pos < end[:, None])  # (B, N)
    if mask is not None:
        visible = visible & mask.bool()
    visible = visible[:, None, None, :].expand(batch, 1, t, n)
    if t > 1:
        last = end[:, None] - t + torch.arange(t, device=device)  # (B, T)
        visible = visible & (pos <= last[:, None, :, None])
    return visible


def _attend(scores: torch.Tensor, visible: torch.Tensor, c_v: torch.Tensor) -> torch.Tensor:
    """Masked softmax over keys, then the value latent: ``(B, H, T, N) -> (B, H, T, r_v)``."""
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return torch.einsum("bhtn,bnr->bhtr", probs, c_v)


def latent_decode_reference(q, c_k, c_v, scale: float, mask=None, start=None, length=None,
                            *, dtype=torch.float64) -> torch.Tensor:
    """Absorbed attention: ``q`` ``(B, H, T, r_k)``, ``c_k`` ``(B, N, r_k)``, ``c_v``
    ``(B, N, r_v)`` -> ``(B, H, T, r_v)`` in ``dtype``."""
    batch, _, t, _ = q.shape
    scores = torch.einsum("bhtr,bnr->bhtn", q.to(dtype), c_k.to(dtype)) * scale
    visible = key_visibility(batch, c_k.shape[1], t, mask, start, length, q.device)
    return _attend(scores, visible, c_v.to(dtype))
