"""RoPE in the Hugging Face ``(cos, sin)`` convention, forwards and backwards, and the log of
the angles of every cached token that ``reconstruct``-mode layers rotate rebuilt keys with.

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
    return rotate_by(x, cos.unsqueeze(1), sin.unsqueeze(1), style, inverse)


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
              inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` by ``cos``/``sin`` that broadcast against ``x[..., :rotary_dim]``."""
    rd = cos.shape[-1]
    head, rest = x[..., :rd], x[..., rd:]
    turned = head * cos + _turn(head, style) * (-sin if inverse else sin)
    if not rest.shape[-1]:
        return turned
    return torch.cat((turned, rest.expand(*turned.shape[:-1], rest.shape[-1])), dim=-1)


class RotaryLog:
    """The RoPE angles of every cached token, shared by a cache's pre-RoPE layers.

    The attention modules hand the ``(cos, sin)`` of the incoming tokens to ``pending`` (a
    forward pre-hook set up by ``compress``); the first pre-RoPE layer to update appends
    them. transformers repeats each frequency's value over its pair (``cat(f, f)`` for
    rotate-half, ``repeat_interleave(f, 2)`` for interleaved), so one value per pair is kept.
    """

    def __init__(self, style: str, max_cache_len: int | None = None):
        self.style, self.max_cache_len = style, max_cache_len
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cos = self.sin = None  # (b, n, rotary_dim / 2)

    def incoming(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending is None:
            raise RuntimeError(
                "rope='reconstruct' needs the RoPE angles of each step: the attention module "
                "did not receive `position_embeddings=(cos, sin)`; use rope='commute'")
        return self.pending

    def _per_pair(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., : x.shape[-1] // 2] if self.style == "half" else x[..., 0::2]

    def _per_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, x), dim=-1) if self.style == "half" else x.repeat_interleave(2, -1)

    def append(self, positions: torch.Tensor | None) -> None:
        cos, sin = (self._per_pair(x) for x in self.incoming())
        if self.cos is None:
            if self.max_cache_len is None:
                self.cos, self.sin = cos[:, :0], sin[:, :0]
            else:
                shape = (cos.shape[0], self.max_cache_len, cos.shape[-1])
                self.cos, self.sin = cos.new_zeros(shape), sin.new_zeros(shape)
        if positions is None:
            self.cos = torch.cat([self.cos, cos], dim=1)
            self.sin = torch.cat([self.sin, sin], dim=1)
        else:
            self.cos.index_copy_(1, positions, cos)
            self.sin.index_copy_(1, positions, sin)

    def angles(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the first ``length`` cached tokens, one value per head dim."""
        return self._per_dim(self.cos[:, :length]), self._per_dim(self.sin[:, :length])

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.cos, self.sin) if t is not None]

    def map(self, fn) -> None:
        """Apply ``fn`` to the logged ``cos`` and ``sin`` (a batch or length operation that
        the owning cache layer applies to its own latents too)."""
        if self.cos is not None:
            self.cos, self.sin = fn(self.cos), fn(self.sin)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a growing log; a preallocated one is
        indexed by position and rewritten in place)."""
        if tokens_to_remove < 0 and self.max_cache_len is None:
            self.map(lambda t: t[:, :tokens_to_remove])

    def reset(self) -> None:
        self.pending = None
        if self.max_cache_len is None:
            self.cos = self.sin = None
        else:
            self.map(torch.zero_)
