"""A transformers ``Cache`` whose layers hold low-rank latents instead of keys and values.

``update()`` stores ``P·k`` and ``P·v`` and returns their reconstructions ``Pᵀ·c``, so a
model's own attention code runs unchanged in eager mode and Python keeps owning the
cache's shapes (DESIGN.md). The compiled path rewrites the reconstruction away.

Keys of a ``reconstruct``-mode layer are cached before RoPE (the paper's joint basis): the
layer turns the incoming post-RoPE keys back, and rotates the rebuilt keys again at every
step with the angles of their own positions, kept once per cache in a :class:`RotaryLog`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from .latent_ops import project, reconstruct
from .rotary import rotate


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


@dataclass
class LayerBases:
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

    def __post_init__(self):
        self.k_rebuild = self.k_basis if self.k_rebuild is None else self.k_rebuild
        self.v_rebuild = self.v_basis if self.v_rebuild is None else self.v_rebuild

    def to(self, like: torch.Tensor) -> "LayerBases":
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
        k = keys if self.k_basis is None else reconstruct(keys, self.k_rebuild, self.num_kv_heads)
        v = values if self.v_basis is None else reconstruct(values, self.v_rebuild, self.num_kv_heads)
        if self.rotary is not None and self.k_basis is not None:
            k = rotate(k, *self.rotary.angles(k.shape[-2]), self.rotary.style)
        return k, v


class LatentDynamicLayer(DynamicLayer):
    """A growing cache of latents (``(b, 1, n, r)``; the head axis keeps the seq axis at -2,
    so masks, ``get_seq_length``, cropping and beam reordering work as for full keys)."""

    def __init__(self, bases: LayerBases, logs_rotary: bool = False):
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


class LatentStaticLayer(StaticLayer):
    """A preallocated cache of latents, written in place at the cache positions."""

    def __init__(self, max_cache_len: int, bases: LayerBases, logs_rotary: bool = False):
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


class LatentCache(Cache):
    """Latent layers where a plan compresses a layer, the given layers elsewhere."""

    def __init__(self, layers: list, rotary: RotaryLog | None = None):
        super().__init__(layers=layers)
        self.rotary = rotary

    @classmethod
    def from_cache(cls, cache: Cache, bases: dict[int, LayerBases]) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``bases`` covers."""
        static = [l for l in cache.layers if type(l) is StaticLayer]
        styles = {b.rope_style for b in bases.values() if b.rope_style}
        rotary = None
        if styles:
            rotary = RotaryLog(styles.pop(), static[0].max_cache_len if static else None)
        layers, log_owner = [], None
        for i, layer in enumerate(cache.layers):
            if i in bases and type(layer) in (DynamicLayer, StaticLayer):
                b = bases[i]
                if b.rope_style:
                    b = replace(b, rotary=rotary)
                    log_owner = i if log_owner is None else log_owner
                owns = log_owner == i
                layer = (LatentDynamicLayer(b, owns) if type(layer) is DynamicLayer
                         else LatentStaticLayer(layer.max_cache_len, b, owns))
            layers.append(layer)
        return cls(layers, rotary)

    def cache_bytes(self) -> int:
        """Bytes held by the cache's tensors (keys, values, RoPE angles), measured."""
        tensors = [t for layer in self.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
        tensors += self.rotary.tensors() if self.rotary is not None else []
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
