"""A transformers ``Cache`` whose layers hold low-rank latents instead of keys and values.

``update()`` stores ``P·k`` and ``P·v`` and returns their reconstructions ``Pᵀ·c``, so a
model's own attention code runs unchanged in eager mode and Python keeps owning the
cache's shapes (DESIGN.md). The compiled path rewrites the reconstruction away.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from .latent_ops import project, reconstruct


@dataclass
class LayerBases:
    """One layer's bases, ``(r, h_kv*d)`` each; ``None`` keeps that side full width."""

    k_basis: torch.Tensor | None
    v_basis: torch.Tensor | None
    num_kv_heads: int

    def to(self, like: torch.Tensor) -> "LayerBases":
        cast = lambda b: None if b is None else b.to(device=like.device, dtype=like.dtype)
        return LayerBases(cast(self.k_basis), cast(self.v_basis), self.num_kv_heads)

    def compress(self, keys: torch.Tensor, values: torch.Tensor):
        k = keys if self.k_basis is None else project(keys, self.k_basis)
        v = values if self.v_basis is None else project(values, self.v_basis)
        return k, v

    def expand(self, keys: torch.Tensor, values: torch.Tensor):
        k = keys if self.k_basis is None else reconstruct(keys, self.k_basis, self.num_kv_heads)
        v = values if self.v_basis is None else reconstruct(values, self.v_basis, self.num_kv_heads)
        return k, v


class LatentDynamicLayer(DynamicLayer):
    """A growing cache of latents (``(b, 1, n, r)``; the head axis keeps the seq axis at -2,
    so masks, ``get_seq_length``, cropping and beam reordering work as for full keys)."""

    def __init__(self, bases: LayerBases):
        super().__init__()
        self.bases = bases

    def lazy_initialization(self, key_states, value_states):
        self.bases = self.bases.to(key_states)
        super().lazy_initialization(key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self.bases.compress(key_states, value_states)
        self.keys = torch.cat([self.keys, k], dim=-2) if self.keys.numel() else k
        self.values = torch.cat([self.values, v], dim=-2) if self.values.numel() else v
        return self.bases.expand(self.keys, self.values)


class LatentStaticLayer(StaticLayer):
    """A preallocated cache of latents, written in place at the cache positions."""

    def __init__(self, max_cache_len: int, bases: LayerBases):
        super().__init__(max_cache_len)
        self.bases = bases

    def lazy_initialization(self, key_states, value_states):
        self.bases = self.bases.to(key_states)
        k, v = self.bases.compress(key_states[:, :, :0], value_states[:, :, :0])
        super().lazy_initialization(k, v)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = super().update(*self.bases.compress(key_states, value_states))
        return self.bases.expand(keys, values)


class LatentCache(Cache):
    """Latent layers where a plan compresses a layer, the given layers elsewhere."""

    def __init__(self, layers: list):
        super().__init__(layers=layers)

    @classmethod
    def from_cache(cls, cache: Cache, bases: dict[int, LayerBases]) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``bases`` covers."""
        layers = []
        for i, layer in enumerate(cache.layers):
            if i in bases and type(layer) is DynamicLayer:
                layer = LatentDynamicLayer(bases[i])
            elif i in bases and type(layer) is StaticLayer:
                layer = LatentStaticLayer(layer.max_cache_len, bases[i])
            layers.append(layer)
        return cls(layers)

    def cache_bytes(self) -> int:
        """Bytes held by the cache's key/value tensors (measured from the tensors)."""
        total = 0
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
