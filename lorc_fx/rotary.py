"""RoPE in the Hugging Face ``(cos, sin)`` convention, forwards and backwards.

``cos``/``sin`` are ``(b, s, rotary_dim)``, repeated per pair as the layout wants
(``cat(f, f)`` for rotate-half, ``repeat_interleave(f, 2)`` for interleaved); the head dims
past ``rotary_dim`` pass through.
"""
from __future__ import annotations

import torch


def _turn(x: torch.Tensor, style: str) -> torch.Tensor:
    """Multiply each (re, im) pair by i."""
    if style == "half":
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((-b, a), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
           inverse: bool = False) -> torch.Tensor:
    """Rotate ``x (b, h, s, d)`` by the angles in ``cos``/``sin`` (or back, with ``inverse``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    head, rest = x[..., :rd], x[..., rd:]
    turned = head * cos + _turn(head, style) * (-sin if inverse else sin)
    return torch.cat((turned, rest), dim=-1) if rest.shape[-1] else turned
