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


class StoresBesideWindow:
    """Policy of a layer that holds per-row tensors besides ``keys`` / ``values`` (codes,
    scales, sinks): every batch operation ``generate`` applies (reordering beams, repeating or
    selecting rows) is applied to them too, through ``_map_stores(fn)``, ``fn`` an operation
    on the batch axis 0. Offloading them is not supported."""

    def _map_stores(self, fn) -> None:
        raise NotImplementedError

    def _kept_after_crop(self, tokens_to_remove: int) -> int | None:
        """How many tokens ``crop(tokens_to_remove)`` keeps (``DynamicLayer.crop``'s
        contract: a negative count); None where there is nothing to cut."""
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not "
                             "supported: pass a negative number of tokens to remove")
        length = self.get_seq_length()
        if tokens_to_remove == 0 or length == 0:
            return None
        return max(length + tokens_to_remove, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_stores(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_stores(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_stores(lambda t: t[indices, ...])

    def offload(self):
        raise NotImplementedError(f"offloading a {type(self).__name__} is not supported")

    def prefetch(self):
        raise NotImplementedError(f"offloading a {type(self).__name__} is not supported")


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
        """Allocate the buffers (``_allocate``) and give them fixed addresses, as
        ``StaticLayer`` does (not while dynamo traces)."""
        self.bases = self.bases.to(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(key_states, value_states)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            for tensor in (*self.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def _allocate(self, key_states, value_states) -> None:
        """``(b, 1, max, r)`` for a latent side, ``(b, h_kv, max, d)`` for a side kept raw
        (the two sides can differ, so not StaticLayer's one head count)."""
        self.keys = self._buffer(key_states, self.bases.k_basis, self.max_cache_len)
        self.values = self._buffer(value_states, self.bases.v_basis, self.max_cache_len)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the layer holds (the RoPE angle log is the cache's)."""
        return [self.keys, self.values]

    @staticmethod
    def _buffer(states: torch.Tensor, basis: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """Zeros for ``tokens`` tokens of one side: ``(b, 1, tokens, r)`` latents, or
        ``(b, h_kv, tokens, d)`` for a side kept raw."""
        b, h, _, d = states.shape
        heads, width = (h, d) if basis is None else (1, basis.shape[0])
        return states.new_zeros(b, heads, tokens, width)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
            self.bases.rotary.append(positions)
        keys, values = super().update(*self.bases.compress(key_states, value_states))
        return self.bases.expand(keys, values)
