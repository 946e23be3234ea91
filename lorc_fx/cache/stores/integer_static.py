"""The static store of a side stored as integer codes: the static counterpart of
``stores.integer.IntegerStore``, for ``generate`` with ``cache_implementation="static"`` and
``latent_cache(model, max_cache_len)``.

Every buffer is allocated once, for ``max_cache_len`` tokens, in ``codes/integer.py``'s layout,
and written in place by ``index_copy_`` at positions computed from the tensor
``cumulative_length`` (as transformers' ``StaticLayer`` does), so ``update`` holds no branch
on data and a compiled decode step traces once for every position.

- **per channel** (groups of G tokens): codes ``(b, h, d, slots, G·bits/8)``, scales and zero
  points ``(b, h, d, slots)``, with ``slots = ceil(max_cache_len / G) + 1``; beside them a
  full-precision *window* ``(b, h, G, d)`` holding the tokens of the current group (the one
  position ``cumulative_length`` falls in). A write of ``t`` tokens stages the window and the
  new tokens over the ``k = ceil(t / G) + 1`` groups from the current one (enough for any
  start within the group, and for the group current after the write), re-quantizes those
  groups from their valid tokens only (masked min/max) and writes the ``k`` group slots; the
  staged group that is current afterwards becomes the window. The last slot is spare: the
  ``k`` groups can reach one past the last token written, and past ``max_cache_len``. A
  decode step's one token is written into the window in place and only its group is
  re-quantized and written (staging would do two); when the token completes the group, the
  window keeps its tokens, which the next write, at offset 0, masks out as it masks every
  slot past its own tokens.
- **per token** (groups of channels): codes ``(b, h, max_cache_len, groups, bytes)``, scales
  and zero points ``(b, h, max_cache_len, groups)``; a token's codes do not depend on other
  tokens, so each is quantized once, as written. No window.

A sliding-window layer's store is a **ring** (``allocate(..., ring=True)``,
``cache.LatentStaticSlidingLayer``): ``max_cache_len`` whole groups of slots and no spare one,
token ``p`` at slot ``p mod max_cache_len`` (group ``g`` at group slot ``g mod`` their count);
the layer writes at most ``W + G - 1`` tokens at a time (W its window) and sizes the ring so
no write reaches a slot the window still reads.

A group's codes are always computed from its tokens in full precision (the window), never
from codes, so nothing is rounded twice; once the window has moved past a group its codes are
final and equal, bit for bit, to the dynamic layer's for the same tokens.

What attention reads is the whole ``(b, ·, max_cache_len, ·)`` side dequantized through
``lorc::dequantize`` (one node; positions past the cache's length are masked), rebuilt by the
codec. **The current partial group is read from its quantized image**, re-quantized at every
step from the tokens it holds so far; the dynamic layer reads that group in full precision
from its residual window. So the two layers agree on whole groups and differ, by at most
half a step of the partial group's range, on the last ``length mod G`` tokens (and, for a
per-token side, on every token the dynamic layer still holds in its window).

Bytes, for ``max_cache_len`` a whole number of groups: the plan's rate for ``max_cache_len``
tokens (``Plan.cache_bytes_per_token``) plus, per per-channel side and batch row, the window
(``h·G·d`` floats) and the spare slot (``h·d·(G·bits/8 + 2·scale bytes)``); docs/design.md,
"Quantized latents".
"""
from __future__ import annotations

import math

import torch

from lorc_fx.codes.integer import (ChannelSplit, QuantizedTensor, QuantSpec, SplitTensor, encode,
                                   zero_and_scale)

from ..latent_ops import dequantized
from .full import buffer


def _write_groups(codes: QuantizedTensor, x: torch.Tensor, valid: torch.Tensor | None,
                  dim: int, index: torch.Tensor) -> None:
    """Quantize the groups ``x (..., groups, group)``, each over its ``valid`` elements only
    (``None``: all; a group with none gets zero and scale 1), by ``codes.integer.quantize``'s
    arithmetic (on whole groups its results, bit for bit), and write their scales, zero points
    and codes at ``index`` along ``dim`` of ``codes``' buffers, in place.

    The codes are encoded with the scales and zero points read back from the buffers just
    written (the same values: ``round_to`` makes them exact in the scale dtype). Computed
    inline instead, Inductor recomputes a group's scale, bit casts included, for every element
    it encodes: a compiled write of 4096 tokens of keys (3 heads of 64 channels, 8 bits, groups
    of 64) took 1.6 ms against 0.6 ms this way (docs/design.md, "Quantized latents")."""
    x = x.float()
    if valid is None:
        lo, hi = x.amin(-1), x.amax(-1)
    else:
        some = valid.any(-1)
        lo = torch.where(some, torch.where(valid, x, math.inf).amin(-1), 0.0)
        hi = torch.where(some, torch.where(valid, x, -math.inf).amax(-1), 0.0)
    bits, scale_dtype = codes.spec.bits, codes.scale.dtype
    zero, scale = zero_and_scale(lo, hi, (1 << bits) - 1, scale_dtype)
    codes.scale.index_copy_(dim, index, scale.to(scale_dtype))
    codes.zero.index_copy_(dim, index, zero.to(scale_dtype))
    stored = lambda buffer: buffer.index_select(dim, index).float()
    codes.payload.index_copy_(dim, index, encode(x, stored(codes.zero), stored(codes.scale), bits))


def _write_per_channel(codes: QuantizedTensor, window: torch.Tensor, states: torch.Tensor,
                       start: torch.Tensor, ring: int = 0) -> None:
    """Write ``states (b, h, t, d)`` at token ``start`` (a 0-d tensor) into per-channel
    ``codes`` and its ``window`` (the module docstring), in place; with ``ring`` group slots,
    group ``g`` is written at slot ``g mod ring`` (a sliding window's ring buffer)."""
    group, t = codes.spec.group, states.shape[-2]
    b, h, _, d = window.shape
    if t == 1:  # a decode step: its token joins the window, whose one group is re-quantized
        offset = (start % group).view(1)
        window.index_copy_(2, offset, states)
        valid = (torch.arange(group, device=states.device) <= offset).view(1, group)
        index = (start // group).view(1)
        _write_groups(codes, window.transpose(-1, -2).reshape(b, h, d, 1, group), valid, 3,
                      index % ring if ring else index)
        return
    groups = (t + group - 1) // group + 1
    offset = start % group
    steps = torch.arange(groups * group, device=states.device)
    staging = torch.cat([window, window.new_zeros(b, h, (groups - 1) * group, d)], dim=-2)
    staging.index_copy_(2, offset + steps[:t], states)
    valid = (steps < offset + t).view(groups, group)
    grouped = staging.transpose(-1, -2).reshape(b, h, d, groups, group)
    index = start // group + steps[:groups]
    _write_groups(codes, grouped, valid, 3, index % ring if ring else index)
    window.copy_(staging.index_select(2, (offset + t) // group * group + steps[:group]))


def _write_per_token(codes: QuantizedTensor, states: torch.Tensor, positions: torch.Tensor) -> None:
    """Quantize ``states (b, h, t, d)`` per token (channels padded with the last one to whole
    groups, as ``quantize`` pads) and write them at ``positions``, in place."""
    group, width = codes.spec.group, states.shape[-1]
    pad = -width % group
    if pad:
        states = torch.cat([states, states[..., -1:].expand(*states.shape[:-1], pad)], dim=-1)
    grouped = states.reshape(*states.shape[:-1], (width + pad) // group, group)
    _write_groups(codes, grouped, None, 2, positions)


class IntegerStaticStore:
    """A side stored as ``spec.bits``-bit codes over all ``max_cache_len`` tokens: ``codes``
    (a ``QuantizedTensor`` or ``SplitTensor`` of fixed buffers; a per-channel payload holds
    one spare group slot) beside the window (the current group's tokens of a per-channel
    side, nothing, zero tokens, for a per-token side). See the module docstring for the
    layout, the writes, and what attention reads of the partial group: **its quantized
    image, re-quantized at every step** (the dynamic store reads it in full precision)."""

    def __init__(self, spec: QuantSpec | ChannelSplit):
        if not spec.quantized or spec.axis not in (-2, -1):
            raise ValueError("an integer store takes specs of fewer than 16 bits, per channel "
                             "(QuantSpec.per_channel) or per token (per_token)")
        self.spec = spec
        self.codes: QuantizedTensor | SplitTensor | None = None
        self.max_cache_len = 0
        self.ring = 0  # group slots of a ring buffer (a sliding window), else 0

    def allocate(self, states: torch.Tensor, basis: torch.Tensor | None,
                 max_cache_len: int, ring: bool = False) -> torch.Tensor:
        """Zeroed codes for ``max_cache_len`` tokens; returns the window. A channel split's
        runs share one window and hold codes of their own channels each. ``ring``: the
        ``max_cache_len`` slots (whole groups) are a ring buffer, token ``p`` at slot
        ``p mod max_cache_len`` (the caller writes per-token sides at those positions), with
        no spare group slot."""
        self.max_cache_len = max_cache_len
        if ring:
            if max_cache_len % self.spec.group:
                raise ValueError(f"a ring of {max_cache_len} slots is not whole groups of "
                                 f"{self.spec.group}")
            self.ring = max_cache_len // self.spec.group
        window = buffer(states, basis, self.spec.group if self.spec.axis == -2 else 0)
        if isinstance(self.spec, ChannelSplit):
            self.codes = SplitTensor(tuple(self._codes_of(window[..., at:at + c], states, part)
                                           for at, c, part in self.spec.specs()), self.spec)
        else:
            self.codes = self._codes_of(window, states, self.spec)
        return window

    def _codes_of(self, window: torch.Tensor, states: torch.Tensor, spec: QuantSpec
                  ) -> QuantizedTensor:
        """Zeroed codes of one spec for the side whose full-precision part is ``window``."""
        b, h, _, d = window.shape
        if spec.axis == -2:
            lead = (b, h, d, self.ring or -(-self.max_cache_len // spec.group) + 1)
        else:
            lead = (b, h, self.max_cache_len, -(-d // spec.group))
        scale_dtype = spec.scale_dtype or states.dtype
        payload = states.new_zeros(*lead, spec.group * spec.bits // 8, dtype=torch.uint8)
        return QuantizedTensor(payload, states.new_zeros(lead, dtype=scale_dtype),
                               states.new_zeros(lead, dtype=scale_dtype), spec,
                               (b, h, self.max_cache_len, d), states.dtype)

    def write(self, window: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
              start: torch.Tensor) -> None:
        """Write ``states`` at ``positions`` (from token ``start``, a 0-d tensor), in place."""
        if isinstance(self.codes, SplitTensor):  # each run through its channels of the window
            for (at, c, _), part in zip(self.spec.specs(), self.codes.parts):
                _write_per_channel(part, window[..., at:at + c], states[..., at:at + c], start,
                                   self.ring)
        elif self.spec.axis == -2:
            _write_per_channel(self.codes, window, states, start, self.ring)
        else:
            _write_per_token(self.codes, states, positions)

    def read(self, window: torch.Tensor) -> torch.Tensor:
        """Every allocated position, dequantized (one ``lorc::dequantize`` node)."""
        return dequantized(self.codes)

    def place_sinks(self, positions: torch.Tensor) -> None:
        pass  # every token is stored alike

    def tensors(self) -> list[torch.Tensor]:
        """Packed codes, scales, zero points (the window is the layer's)."""
        return [] if self.codes is None else list(self.codes.tensors)
