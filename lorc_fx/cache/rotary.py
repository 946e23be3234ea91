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


def pair_dims(pair: int, rotary_dim: int, style: str) -> tuple[int, int]:
    """The ``(re, im)`` dims within a head of rotary pair ``pair``."""
    return (pair, pair + rotary_dim // 2) if style == "half" else (2 * pair, 2 * pair + 1)


def per_pair(x: torch.Tensor, style: str) -> torch.Tensor:
    """A table of one value per rotary dim (``cos``/``sin``, the layout repeating each pair's
    value) as one value per pair, ``rotary_dim / 2`` wide."""
    return x[..., : x.shape[-1] // 2] if style == "half" else x[..., 0::2]


def frequency_pairs(rows: torch.Tensor, num_heads: int, rotary_dim: int,
                    style: str) -> tuple[int, ...] | None:
    """Each row's rotary pair, where every row of ``rows`` ``(r, h*d)`` is zero outside one
    pair's two dims of every head (a RoPE-commuting basis, ``plan.spectra``); else None.

    Rebuilt from such rows, a key's pair ``f`` is a combination of the latent channels on
    ``f`` alone, so RoPE turns each channel's contribution by its own pair's angle, and
    attention can score the latent without rebuilding keys."""
    if not rows.numel() or rotary_dim == 0:
        return None
    per_dim = rows.reshape(rows.shape[0], num_heads, -1).ne(0).any(dim=1)  # (r, d)
    pairs = []
    for support in per_dim:
        dims = support.nonzero().flatten().tolist()
        first = dims[0] if dims else 0
        pair = first % (rotary_dim // 2) if style == "half" else first // 2
        if first >= rotary_dim or not set(dims) <= set(pair_dims(pair, rotary_dim, style)):
            return None
        pairs.append(pair)
    return tuple(pairs)


class RotaryLog:
    """The RoPE angles of every cached token, shared by a cache's pre-RoPE layers.

    The attention modules hand the ``(cos, sin)`` of the incoming tokens to ``pending`` (a
    forward pre-hook set up by ``compress``); the first pre-RoPE layer to update appends
    them. transformers repeats each frequency's value over its pair (``cat(f, f)`` for
    rotate-half, ``repeat_interleave(f, 2)`` for interleaved) and every pair of a token has
    one magnitude (``attention_scaling``, 1 for plain RoPE), so a token's ``(cos, sin)`` is
    ``m (cos θ_i, sin θ_i)``: the log keeps the angle ``θ_i`` per pair and ``m`` per token,
    ``rotary_dim / 2 + 1`` values a token (``plan.planner`` charges that many).

    Invariant: ``angles`` gives back what ``append`` received, to rounding; eager appends
    check it (a model whose pairs differ in magnitude is refused there), traced ones trust
    it. Angles are logged in float16 where the model computes in bfloat16 (bfloat16 holds an
    angle near π only to 0.008 rad, float16 to 0.001, finer than bfloat16's own ``cos``),
    otherwise in the model's dtype.
    """

    def __init__(self, style: str, max_cache_len: int | None = None, rotary_dim: int = 0,
                 turn: int = 1):
        self.style, self.max_cache_len, self.rotary_dim = style, max_cache_len, rotary_dim
        self.turn = turn  # -1: the model turns by -θ, so the log keeps -θ (``RopeLayout``)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.angle = self.magnitude = None  # (b, n, rotary_dim / 2), (b, n, 1)
        self.dtype: torch.dtype | None = None  # what ``angles`` hands back: the model's

    def incoming(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(cos, sin)`` handed over, one value per rotary head dim (tables of one
        value per pair, ``rotary_dim / 2`` wide, repeated as the layout wants); ``sin``
        negated where the model turns its pairs by -θ (``turn``)."""
        if self.pending is None:
            raise RuntimeError(
                "rope='reconstruct' needs the RoPE angles of each step: the attention module "
                "did not receive `position_embeddings=(cos, sin)`; use rope='commute'")
        cos, sin = self.pending
        if self.turn < 0:
            sin = -sin
        if cos.shape[-1] * 2 == self.rotary_dim:  # one value per pair (gpt-oss): per dim
            cos, sin = self._per_dim(cos), self._per_dim(sin)
        return cos, sin

    def _per_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, x), dim=-1) if self.style == "half" else x.repeat_interleave(2, -1)

    def _polar(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(θ, m)`` of one value per pair of ``(cos, sin)``, in the log's dtype."""
        given = cos.dtype
        stored = torch.float16 if given == torch.bfloat16 else given
        wide = torch.promote_types(given, torch.float32)
        cos, sin = per_pair(cos, self.style).to(wide), per_pair(sin, self.style).to(wide)
        angle = torch.atan2(sin, cos)
        magnitude = torch.hypot(cos, sin).mean(-1, keepdim=True)
        if not torch.compiler.is_compiling():  # a traced graph has no data-dependent branch
            tol = 8 * torch.finfo(stored).eps + 2 * torch.finfo(given).eps
            rebuilt = magnitude * torch.cos(angle), magnitude * torch.sin(angle)
            if not all(torch.allclose(r, x, rtol=0, atol=tol) for r, x in zip(rebuilt, (cos, sin))):
                raise ValueError(
                    "rope='reconstruct' logs one RoPE angle per pair and one magnitude per "
                    "token, but this model's (cos, sin) pairs differ in magnitude within a "
                    "token; use rope='commute'")
        return angle.to(stored), magnitude.to(stored)

    def append(self, positions: torch.Tensor | None) -> None:
        cos, sin = self.incoming()
        if self.dtype is None:
            self.dtype = cos.dtype
        angle, magnitude = self._polar(cos, sin)
        if self.angle is None:
            if self.max_cache_len is None:
                self.angle, self.magnitude = angle[:, :0], magnitude[:, :0]
            else:
                self.angle = angle.new_zeros(angle.shape[0], self.max_cache_len, angle.shape[-1])
                self.magnitude = magnitude.new_zeros(angle.shape[0], self.max_cache_len, 1)
        if self.angle.shape[0] != angle.shape[0]:  # a shared row meets per-row angles
            rows = max(self.angle.shape[0], angle.shape[0])
            self.angle, self.magnitude, angle, magnitude = (
                t.expand(rows, *t.shape[1:]).contiguous()
                for t in (self.angle, self.magnitude, angle, magnitude))
        if positions is None:
            self.angle = torch.cat([self.angle, angle], dim=1)
            self.magnitude = torch.cat([self.magnitude, magnitude], dim=1)
        else:
            self.angle.index_copy_(1, positions, angle)
            self.magnitude.index_copy_(1, positions, magnitude)

    def angles(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the first ``length`` cached tokens, one value per head dim, in
        the model's dtype."""
        wide = torch.promote_types(self.dtype, torch.float32)
        angle, magnitude = self.angle[:, :length].to(wide), self.magnitude[:, :length].to(wide)
        return (self._per_dim(magnitude * torch.cos(angle)).to(self.dtype),
                self._per_dim(magnitude * torch.sin(angle)).to(self.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.angle, self.magnitude) if t is not None]

    def map(self, fn) -> None:
        """Apply ``fn`` to the logged angles and magnitudes (a batch or length operation that
        the owning cache layer applies to its own latents too)."""
        if self.angle is not None:
            self.angle, self.magnitude = fn(self.angle), fn(self.magnitude)

    def map_batch(self, fn) -> None:
        """Apply ``fn``, an operation on the batch axis 0 (beams, repeat/select). A log of one
        row holds angles every row shares (the positions transformers computed once for the
        batch), so it stays as it is; ``append`` widens it if per-row angles come later."""
        if self.angle is not None and self.angle.shape[0] > 1:
            self.map(fn)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a growing log; a preallocated one is
        indexed by position and rewritten in place)."""
        if tokens_to_remove < 0 and self.max_cache_len is None:
            self.map(lambda t: t[:, :tokens_to_remove])

    def reset(self) -> None:
        self.pending = None
        if self.max_cache_len is None:
            self.angle = self.magnitude = None
        else:
            self.map(torch.zero_)
