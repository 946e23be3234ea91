"""A preallocated (static) cache layer whose sides are stored as integer codes: the static
counterpart of ``quantized_layers.QuantizedLatentDynamicLayer``, for ``generate`` with
``cache_implementation="static"`` and ``latent_cache(model, max_cache_len)``.

Every buffer is allocated once, for ``max_cache_len`` tokens, in ``quantize.py``'s layout,
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
  ``k`` groups can reach one past the last token written, and past ``max_cache_len``.
- **per token** (groups of channels): codes ``(b, h, max_cache_len, groups, bytes)``, scales
  and zero points ``(b, h, max_cache_len, groups)``; a token's codes do not depend on other
  tokens, so each is quantized once, as written. No window.

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

from .latent_ops import dequantized
from .layers import LatentCodec, LatentStaticLayer
from .quantize import (ChannelSplit, QuantizedTensor, QuantSpec, SplitTensor, encode,
                       zero_and_scale)


def _write_groups(codes: QuantizedTensor, x: torch.Tensor, valid: torch.Tensor | None,
                  dim: int, index: torch.Tensor) -> None:
    """Quantize the groups ``x (..., groups, group)``, each over its ``valid`` elements only
    (``None``: all; a group with none gets zero and scale 1), by ``quantize.quantize``'s
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
                       start: torch.Tensor) -> None:
    """Write ``states (b, h, t, d)`` at token ``start`` (a 0-d tensor) into per-channel
    ``codes`` and its ``window`` (the module docstring), in place."""
    group, t = codes.spec.group, states.shape[-2]
    b, h, _, d = window.shape
    groups = (t + group - 1) // group + 1
    offset = start % group
    steps = torch.arange(groups * group, device=states.device)
    staging = torch.cat([window, window.new_zeros(b, h, (groups - 1) * group, d)], dim=-2)
    staging.index_copy_(2, offset + steps[:t], states)
    valid = (steps < offset + t).view(groups, group)
    grouped = staging.transpose(-1, -2).reshape(b, h, d, groups, group)
    _write_groups(codes, grouped, valid, 3, start // group + steps[:groups])
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


class QuantizedLatentStaticLayer(LatentStaticLayer):
    """A preallocated cache whose sides are stored as ``spec.bits``-bit codes where their spec
    (``k_spec`` / ``v_spec``, as ``QuantizedLatentDynamicLayer`` takes them) says; a side
    without a spec is the plain static latent buffer.

    ``k_codes`` / ``v_codes`` are the quantized sides over all ``max_cache_len`` tokens
    (``QuantizedTensor`` records of fixed buffers; a per-channel payload holds one spare
    group slot); ``keys`` / ``values`` are each side's full-precision part: the whole buffer of an
    unquantized side, the current group's window of a per-channel side, nothing (zero
    tokens) for a per-token side. See the module docstring for the layout, the writes, and
    what attention reads of the partial group: **its quantized image, re-quantized at every
    step** (the dynamic layer reads it in full precision).

    Like ``LatentStaticLayer``: ``reset``, ``reorder_cache`` (beams; buffers permuted in
    place, keeping their addresses) and the RoPE angle log; a static layer has no ``crop``
    nor batch repeat/select.
    """

    def __init__(self, max_cache_len: int, bases: LatentCodec,
                 k_spec: QuantSpec | ChannelSplit | None, v_spec: QuantSpec | None,
                 logs_rotary: bool = False):
        for spec in (k_spec, v_spec):
            if spec is not None and (not spec.quantized or spec.axis not in (-2, -1)):
                raise ValueError("a quantized layer takes specs of fewer than 16 bits, per "
                                 "channel (QuantSpec.per_channel) or per token (per_token)")
        if k_spec is None and v_spec is None:
            raise ValueError("a quantized layer quantizes at least one side")
        super().__init__(max_cache_len, bases, logs_rotary)
        self.k_spec, self.v_spec = k_spec, v_spec
        self.k_codes: QuantizedTensor | None = None
        self.v_codes: QuantizedTensor | None = None

    def _allocate(self, key_states, value_states) -> None:
        self.keys, self.k_codes = self._side(key_states, self.bases.k_basis, self.k_spec)
        self.values, self.v_codes = self._side(value_states, self.bases.v_basis, self.v_spec)

    def _side(self, states: torch.Tensor, basis: torch.Tensor | None,
              spec: QuantSpec | ChannelSplit | None):
        """One side's buffers: (its full-precision part, its codes or ``None``). A channel
        split's runs share one window and hold codes of their own channels each."""
        if spec is None:
            return self._buffer(states, basis, self.max_cache_len), None
        per_channel = spec.axis == -2
        window = self._buffer(states, basis, spec.group if per_channel else 0)
        if isinstance(spec, ChannelSplit):
            return window, SplitTensor(tuple(self._codes_of(window[..., at:at + c], states, part)
                                             for at, c, part in spec.specs()), spec)
        return window, self._codes_of(window, states, spec)

    def _codes_of(self, window: torch.Tensor, states: torch.Tensor, spec: QuantSpec
                  ) -> QuantizedTensor:
        """Zeroed codes of one spec for the side whose full-precision part is ``window``."""
        b, h, _, d = window.shape
        if spec.axis == -2:
            lead = (b, h, d, -(-self.max_cache_len // spec.group) + 1)
        else:
            lead = (b, h, self.max_cache_len, -(-d // spec.group))
        scale_dtype = spec.scale_dtype or states.dtype
        payload = states.new_zeros(*lead, spec.group * spec.bits // 8, dtype=torch.uint8)
        codes = QuantizedTensor(payload, states.new_zeros(lead, dtype=scale_dtype),
                                states.new_zeros(lead, dtype=scale_dtype), spec,
                                (b, h, self.max_cache_len, d), states.dtype)
        return codes

    def _codes(self) -> list[QuantizedTensor | SplitTensor]:
        return [q for q in (self.k_codes, self.v_codes) if q is not None]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the layer holds: full-precision parts (plain buffers, windows),
        packed codes, scales, zero points."""
        return [self.keys, self.values] + [t for q in self._codes() for t in q.tensors]

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides over all ``max_cache_len`` tokens, a quantized one dequantized (one
        ``lorc::dequantize`` node): what ``update`` rebuilds."""
        read = lambda codes, full: full if codes is None else dequantized(codes)
        return read(self.k_codes, self.keys), read(self.v_codes, self.values)

    def _write(self, codes: QuantizedTensor | SplitTensor | None, full: torch.Tensor,
               states: torch.Tensor, positions: torch.Tensor) -> None:
        if codes is None:
            full.index_copy_(2, positions, states)
        elif isinstance(codes, SplitTensor):  # each run through its channels of the window
            for (at, c, _), part in zip(codes.spec.specs(), codes.parts):
                _write_per_channel(part, full[..., at:at + c], states[..., at:at + c],
                                   self.cumulative_length)
        elif codes.spec.axis == -2:
            _write_per_channel(codes, full, states, self.cumulative_length)
        else:
            _write_per_token(codes, states, positions)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new tokens at ``cumulative_length`` on (any number, within
        ``max_cache_len``) and return K/V rebuilt from every allocated position."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tokens = key_states.shape[-2]
        positions = torch.arange(tokens, device=self.device) + self.cumulative_length
        if self.logs_rotary:
            self.bases.rotary.append(positions)
        k, v = self.bases.compress(key_states, value_states)
        self._write(self.k_codes, self.keys, k, positions)
        self._write(self.v_codes, self.values, v, positions)
        self.cumulative_length.add_(tokens)
        return self.bases.expand(*self.latents())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beams: every buffer permuted along batch in place, keeping its fixed address
        (``StaticLayer`` swaps in new tensors), and the RoPE angle log as
        ``_RotaryLogOwner`` permutes it."""
        if self.is_initialized:
            for t in self.tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self._log() is not None:
            self._log().map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        super().reset()
        for q in self._codes():
            for t in q.tensors:
                t.zero_()

    def offload(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")

    def prefetch(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")
