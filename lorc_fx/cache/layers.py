"""Cache layers that hold low-rank latents instead of keys and values.

``update()`` stores ``P·k`` and ``P·v`` and returns their reconstructions ``Pᵀ·c``, so a
model's own attention code runs unchanged in eager mode and Python keeps owning the
cache's shapes (docs/design.md, "Who owns the cache"). The compiled path rewrites the
reconstruction away.

Keys of a ``reconstruct``-mode layer are cached before RoPE (the paper's joint basis): the
layer turns the incoming post-RoPE keys back, and rotates the rebuilt keys again at every
step with the angles of their own positions, kept once per cache in a ``RotaryLog``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from lorc_fx.plan.planner import LayerPlan

from .latent_ops import project, reconstruct, rotated_reconstruct
from .quantize import QuantizedTensor, QuantSpec, quantize
from .rotary import RotaryLog, rotate


@dataclass
class LatentCodec:
    """One layer's bases, ``(r, h_kv*d)`` each; ``None`` keeps that side full width.

    Latents are ``basis·k``, rebuilt as ``rebuildᵀ·latent`` (``rebuild`` defaults to the
    basis: orthonormal rows). ``rope_style`` is set for keys cached before RoPE
    (``reconstruct`` mode); the cache then hands the layer its shared ``rotary`` log.
    """

    k_basis: torch.Tensor | None
    v_basis: torch.Tensor | None
    num_kv_heads: int
    rope_style: str | None = None
    rotary: RotaryLog | None = None
    k_rebuild: torch.Tensor | None = None
    v_rebuild: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: LayerPlan) -> "LatentCodec":
        """The codec of a planned layer; a side the plan cannot compress (keys behind a
        norm) is stored raw. A layer at full rank still stores latents (an orthonormal change
        of basis), so a plan at fraction 1.0 runs the whole latent path."""
        return cls(layer.k_basis if layer.k_compressible else None,
                   layer.v_basis if layer.v_compressible else None, layer.num_kv_heads,
                   layer.rope.style if layer.k_latent_of == "pre_rope" else None,
                   k_rebuild=layer.k_rebuild if layer.k_compressible else None,
                   v_rebuild=layer.v_rebuild if layer.v_compressible else None)

    def __post_init__(self):
        self.k_rebuild = self.k_basis if self.k_rebuild is None else self.k_rebuild
        self.v_rebuild = self.v_basis if self.v_rebuild is None else self.v_rebuild

    def to(self, like: torch.Tensor) -> "LatentCodec":
        cast = lambda b: None if b is None else b.to(device=like.device, dtype=like.dtype)
        return replace(self, k_basis=cast(self.k_basis), v_basis=cast(self.v_basis),
                       k_rebuild=cast(self.k_rebuild), v_rebuild=cast(self.v_rebuild))

    def compress(self, keys: torch.Tensor, values: torch.Tensor):
        if self.rotary is not None and self.k_basis is not None:
            cos, sin = self.rotary.incoming()
            keys = rotate(keys, cos, sin, self.rotary.style, inverse=True)
        k = keys if self.k_basis is None else project(keys, self.k_basis)
        v = values if self.v_basis is None else project(values, self.v_basis)
        return k, v

    def expand(self, keys: torch.Tensor, values: torch.Tensor):
        if self.k_basis is None:
            k = keys
        elif self.rotary is None:
            k = reconstruct(keys, self.k_rebuild, self.num_kv_heads)
        else:
            k = rotated_reconstruct(keys, self.k_rebuild, self.num_kv_heads,
                                    *self.rotary.angles(keys.shape[-2]), self.rotary.style)
        v = values if self.v_basis is None else reconstruct(values, self.v_rebuild, self.num_kv_heads)
        return k, v


class _RotaryLogOwner:
    """Policy of the layer that appends to its cache's ``RotaryLog``: every operation
    ``generate`` applies to cached tokens (cropping rejected drafts, reordering beams,
    repeating or selecting batch rows, resetting) is applied to the logged angles too, so a
    rebuilt key is always rotated by the angle of its own position."""

    logs_rotary: bool

    def _log(self) -> RotaryLog | None:
        return self.bases.rotary if self.logs_rotary else None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self._log() is not None:
            self._log().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._log() is not None:
            self._log().map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._log() is not None:
            self._log().map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._log() is not None:
            self._log().map(lambda t: t[indices, ...])

    def reset(self) -> None:
        super().reset()
        if self._log() is not None:
            self._log().reset()


class LatentDynamicLayer(_RotaryLogOwner, DynamicLayer):
    """A growing cache of latents (``(b, 1, n, r)``; the head axis keeps the seq axis at -2,
    so masks, ``get_seq_length``, cropping and beam reordering work as for full keys)."""

    def __init__(self, bases: LatentCodec, logs_rotary: bool = False):
        super().__init__()
        self.bases, self.logs_rotary = bases, logs_rotary

    def lazy_initialization(self, key_states, value_states):
        self.bases = self.bases.to(key_states)
        super().lazy_initialization(key_states, value_states)

    def get_seq_length(self) -> int:
        """Tokens cached, read off the seq axis (a plan may keep a zero-wide latent)."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            self.bases.rotary.append(None)
        k, v = self.bases.compress(key_states, value_states)
        self.keys = torch.cat([self.keys, k], dim=-2) if self.keys.numel() else k
        self.values = torch.cat([self.values, v], dim=-2) if self.values.numel() else v
        return self.bases.expand(self.keys, self.values)


class LatentStaticLayer(_RotaryLogOwner, StaticLayer):
    """A preallocated cache of latents, written in place at the cache positions."""

    def __init__(self, max_cache_len: int, bases: LatentCodec, logs_rotary: bool = False):
        super().__init__(max_cache_len)
        self.bases, self.logs_rotary = bases, logs_rotary

    def lazy_initialization(self, key_states, value_states):
        """Allocate the buffers: ``(b, 1, max, r)`` for a latent side, ``(b, h_kv, max, d)``
        for a side kept raw (the two sides can differ, so not StaticLayer's one head count)."""
        self.bases = self.bases.to(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self._buffer(key_states, self.bases.k_basis)
        self.values = self._buffer(value_states, self.bases.v_basis)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def _buffer(self, states: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        b, h, _, d = states.shape
        heads, width = (h, d) if basis is None else (1, basis.shape[0])
        return states.new_zeros(b, heads, self.max_cache_len, width)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
            self.bases.rotary.append(positions)
        keys, values = super().update(*self.bases.compress(key_states, value_states))
        return self.bases.expand(keys, values)


def _cat_groups(q: QuantizedTensor | None, new: QuantizedTensor) -> QuantizedTensor:
    """``q`` followed by ``new`` along the token axis (both whole groups of tokens)."""
    if q is None:
        return new
    shape = (*new.shape[:-2], q.shape[-2] + new.shape[-2], new.shape[-1])
    return QuantizedTensor(torch.cat([q.payload, new.payload], dim=-2),
                           torch.cat([q.scale, new.scale], dim=-1),
                           torch.cat([q.zero, new.zero], dim=-1), q.spec, shape, q.dtype)


def _map_batch(q: QuantizedTensor | None, fn) -> QuantizedTensor | None:
    """``q`` with ``fn`` (an operation on the batch axis 0) applied to its tensors."""
    if q is None:
        return None
    payload = fn(q.payload)
    return replace(q, payload=payload, scale=fn(q.scale), zero=fn(q.zero),
                   shape=(payload.shape[0], *q.shape[1:]))


def _first_groups(q: QuantizedTensor, groups: int) -> QuantizedTensor | None:
    """The first ``groups`` groups of tokens of ``q`` (copies: the rest is freed)."""
    if groups == 0:
        return None
    return replace(q, payload=q.payload[..., :groups, :].clone(),
                   scale=q.scale[..., :groups].clone(), zero=q.zero[..., :groups].clone(),
                   shape=(*q.shape[:-2], groups * q.spec.group, q.shape[-1]))


class QuantizedLatentDynamicLayer(LatentDynamicLayer):
    """A growing cache of latents stored as ``spec.bits``-bit integer codes (KIVI-style).

    Each latent side (``(b, 1, n, r)``) is quantized per channel over groups of
    ``spec.group`` tokens (``spec.axis == -2``): the latent's energy sits in its first
    channels, so a scale per channel follows their very different ranges where a per-token
    group would not. Codes are packed (two per byte at 4 bits) with one scale and zero point
    per channel and group, in the model's dtype. The most recent tokens of a group not yet
    full stay in full precision in ``keys`` / ``values`` (the residual window, fewer than
    ``spec.group`` tokens); a group is quantized as it fills. ``k_quant`` / ``v_quant`` hold
    the quantized groups (``None`` before the first). A side kept raw (no basis) or zero-wide
    is never quantized: it lives whole in ``keys`` / ``values``.

    ``update`` returns what attention reads, rebuilt from the dequantized latents.
    ``crop`` keeps the whole groups before the cut as they are and moves the tokens of the
    cut group back into the residual window, dequantized (no second rounding of kept
    groups); beam reordering and batch repeat/select index the packed codes along batch.
    The compiled path (``lorc_backend``) does not support it yet.
    """

    def __init__(self, bases: LatentCodec, spec: QuantSpec, logs_rotary: bool = False):
        if not spec.quantized or spec.axis not in (-2, 2):
            raise ValueError("a quantized latent layer takes a per-channel spec "
                             "(QuantSpec.per_channel) of fewer than 16 bits")
        super().__init__(bases, logs_rotary)
        self.spec = spec
        self.k_quant: QuantizedTensor | None = None
        self.v_quant: QuantizedTensor | None = None

    def _quantizes(self, basis: torch.Tensor | None) -> bool:
        return basis is not None and basis.shape[0] > 0

    def _settle(self, quant: QuantizedTensor | None, window: torch.Tensor, basis):
        """Quantize the whole groups of the residual ``window``; the rest stays in it."""
        whole = window.shape[-2] // self.spec.group * self.spec.group
        if not self._quantizes(basis) or whole == 0:
            return quant, window
        quant = _cat_groups(quant, quantize(window[..., :whole, :], self.spec))
        return quant, window[..., whole:, :].clone()

    def get_seq_length(self) -> int:
        """Tokens cached: the keys' quantized groups and residual window (a side kept raw
        holds every token in its window)."""
        if not self.is_initialized or self.keys is None or self.keys.dim() < 2:
            return 0
        return (self.k_quant.shape[-2] if self.k_quant is not None else 0) + self.keys.shape[-2]

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached latents (raw sides as stored), dequantized: what ``update`` rebuilds."""
        def whole(quant, window):
            return window if quant is None else torch.cat([quant.dequantize(), window], dim=-2)
        return whole(self.k_quant, self.keys), whole(self.v_quant, self.values)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: residual windows, packed codes, scales, zero points."""
        out = [self.keys, self.values]
        for q in (self.k_quant, self.v_quant):
            if q is not None:
                out += [q.payload, q.scale, q.zero]
        return [t for t in out if isinstance(t, torch.Tensor)]

    def update(self, key_states, value_states, *args, **kwargs):
        if is_torchdynamo_compiling():
            raise ValueError("latent_bits < 16 (quantized latents) is supported on the eager "
                             "path only; the compiled path (lorc_backend) needs latent_bits=16")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            self.bases.rotary.append(None)
        k, v = self.bases.compress(key_states, value_states)
        self.keys = torch.cat([self.keys, k], dim=-2) if self.keys.dim() == 4 else k
        self.values = torch.cat([self.values, v], dim=-2) if self.values.dim() == 4 else v
        self.k_quant, self.keys = self._settle(self.k_quant, self.keys, self.bases.k_basis)
        self.v_quant, self.values = self._settle(self.v_quant, self.values, self.bases.v_basis)
        return self.bases.expand(*self.latents())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not "
                             "supported: pass a negative number of tokens to remove")
        length = self.get_seq_length()
        if tokens_to_remove == 0 or length == 0:
            return
        keep = max(length + tokens_to_remove, 0)
        groups = keep // self.spec.group

        def cut(quant, window):
            if quant is None or keep >= quant.shape[-2]:
                start = quant.shape[-2] if quant is not None else 0
                return quant, window[..., :keep - start, :]
            tail = quant.dequantize()[..., groups * self.spec.group:keep, :].clone()
            return _first_groups(quant, groups), tail

        self.k_quant, self.keys = cut(self.k_quant, self.keys)
        self.v_quant, self.values = cut(self.v_quant, self.values)
        if self._log() is not None:
            self._log().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        fn = lambda t: t.index_select(0, beam_idx.to(t.device))
        self.k_quant, self.v_quant = _map_batch(self.k_quant, fn), _map_batch(self.v_quant, fn)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        fn = lambda t: t.repeat_interleave(repeats, dim=0)
        self.k_quant, self.v_quant = _map_batch(self.k_quant, fn), _map_batch(self.v_quant, fn)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        fn = lambda t: t[indices, ...]
        self.k_quant, self.v_quant = _map_batch(self.k_quant, fn), _map_batch(self.v_quant, fn)

    def reset(self) -> None:
        super().reset()
        self.k_quant = self.v_quant = None

    def offload(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")

    def prefetch(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")
