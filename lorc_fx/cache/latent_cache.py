"""``LatentCache``: a transformers ``Cache`` of latent layers where a plan compresses a
layer and the given layers elsewhere."""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicIndexedLayer,
                                     DynamicLayer, DynamicSlidingWindowLayer,
                                     LinearAttentionAndFullAttentionLayer,
                                     LinearAttentionLayer,
                                     LinearAttentionAndSlidingWindowAttentionLayer, StaticLayer,
                                     StaticSlidingWindowLayer, get_layer_types_and_kwargs)

from lorc_fx.codes.vector import VectorBook
from lorc_fx.plan.options import STORED_FLOAT_BITS
from lorc_fx.plan.planner import Code, Plan

from .hybrid_layers import LatentHybridLayer, LatentHybridSlidingLayer, LatentIndexedLayer
from .layers import (LatentCodec, LatentDynamicLayer, LatentSlidingLayer, LatentStaticLayer,
                     LatentStaticSlidingLayer)
from .own_layers import codes_own_states, coded, is_coded
from .rotary import RotaryLog

SideCodes = tuple[Code, Code]  # (keys, values)


def codecs(plan: Plan) -> dict[int, LatentCodec]:
    """The codec of every layer the plan does not skip, by layer index. A scheme that
    stores keys and values themselves (``Scheme.identity_bases``) has its identity bases not
    applied."""
    if plan.scheme.identity_bases:
        return {l.layer: LatentCodec(None, None, l.num_kv_heads) for l in plan.layers
                if not l.skipped}
    return {l.layer: LatentCodec.of(l) for l in plan.layers if not l.skipped}


def side_codes(plan: Plan) -> dict[int, SideCodes]:
    """How each layer's sides are stored (``LayerPlan.k_code`` / ``v_code``)."""
    return {l.layer: (l.k_code, l.v_code) for l in plan.layers if not l.skipped}


def _layer_kinds(config) -> list[tuple[str, dict]]:
    if config is None:
        return []
    return list(zip(*get_layer_types_and_kwargs(config.get_text_config(decoder=True))))


# transformers' dynamic cache layers holding keys and values → the latent layer replacing
# each (any other state they hold kept as transformers keeps it: ``hybrid_layers``)
_FULL_LAYERS = {DynamicLayer: LatentDynamicLayer, DynamicIndexedLayer: LatentIndexedLayer,
                LinearAttentionAndFullAttentionLayer: LatentHybridLayer}
_SLIDING_LAYERS = {DynamicSlidingWindowLayer: LatentSlidingLayer,
                   LinearAttentionAndSlidingWindowAttentionLayer: LatentHybridSlidingLayer}


def layers_kept_as_built(config) -> dict[int, str]:
    """The cache layers a :class:`LatentCache` leaves as transformers builds them for this
    model config (linear attention, convolutions, a model's own layer classes, which only a
    plan without the graph codes: ``own_layers``): index → layer type. Layers holding
    full-attention keys and values (plain, hybrid, indexed) become latent ones and
    sliding-window (or chunked) layers sliding latent ones (:func:`sliding_windows`), so a
    plan must count the others full."""
    return {i: kind for i, (kind, _) in enumerate(_layer_kinds(config))
            if not replaceable(DYNAMIC_LAYER_TYPE_MAPPING.get(kind))}


def static_latent_layers(config) -> bool:
    """Whether every cache layer a plan may code has a static latent counterpart (plain
    full-attention and sliding-window layers do; hybrid and indexed ones do not yet)."""
    kept = layers_kept_as_built(config)
    return all(DYNAMIC_LAYER_TYPE_MAPPING.get(kind) in (DynamicLayer, DynamicSlidingWindowLayer)
               for i, (kind, _) in enumerate(_layer_kinds(config)) if i not in kept)


def replaceable(kind: type) -> bool:
    """Whether transformers' dynamic cache layer class ``kind`` has a latent counterpart."""
    return kind in _FULL_LAYERS or kind in _SLIDING_LAYERS


def sliding_windows(config) -> dict[int, tuple[str, int]]:
    """The sliding-window layers (``sliding_attention``, ``chunked_attention``: one cache
    layer in transformers) of this model config: index → (layer type, window in tokens)."""
    return {i: (kind, kwargs["sliding_window"])
            for i, (kind, kwargs) in enumerate(_layer_kinds(config))
            if DYNAMIC_LAYER_TYPE_MAPPING.get(kind) in _SLIDING_LAYERS}


LatentLayer = LatentDynamicLayer | LatentStaticLayer | LatentStaticSlidingLayer


class LatentCache(Cache):
    """Latent layers where a plan compresses a layer, the given layers elsewhere.

    A fresh cache that adds its layers as they are first written (a model's own cache class,
    as MiniMax's: ``analysis.cache_probe.own_cache_class``) becomes an instance of that class
    with this one mixed in (:func:`_latent_class`): the model's class keeps its own state and
    methods, and each layer it adds is latent where the plan compresses it
    (:class:`_LatentReplicas`)."""

    def __init__(self, layers: list | None = None, rotary: RotaryLog | None = None,
                 **cache_kwargs):
        super().__init__(layers=layers, **cache_kwargs)
        self.rotary = rotary
        self.sink_positions: torch.Tensor | None = None

    @classmethod
    def from_cache(cls, cache: Cache, plan: Plan, prefill_as_stored: bool = False
                   ) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``plan`` compresses
        for a latent one, each side stored as its code says; ``prefill_as_stored``: a prefill
        attends its own tokens read back as stored, not as it computed them (one-forward
        measurements: ``layers._PrefillAsComputed``)."""
        if any(type(l) is StaticLayer for l in cache.layers) \
                and not plan.scheme.capabilities.static_cache:
            raise ValueError(f"a {plan.scheme.title} plan needs a dynamic cache: a static cache "
                             "(cache_implementation='static') is not supported for it yet")
        return cls.from_codecs(cache, codecs(plan), side_codes(plan), prefill_as_stored)

    @classmethod
    def from_codecs(cls, cache: Cache, bases: dict[int, LatentCodec],
                    codes: dict[int, SideCodes] | None = None, prefill_as_stored: bool = False
                    ) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``bases`` covers for
        a :class:`LatentDynamicLayer` / :class:`LatentStaticLayer`, its sides stored as
        ``codes`` say (default: in the model's dtype); ``prefill_as_stored`` as
        :meth:`from_cache`. A ``cache`` of a class of its own that adds its layers as they
        are first written gives a latent cache of that class that does the same."""
        static = [l for l in cache.layers if type(l) is StaticLayer]
        replicas = _LatentReplicas(bases, codes or {}, prefill_as_stored,
                                   _rotary_log(bases, static[0].max_cache_len if static else None))
        if not cache.layers and cache.layer_class_to_replicate is not None:  # built lazily
            lazy = _latent_class(type(cache))()
            lazy.rotary = replicas.rotary
            replicas.replicate_for(lazy)
            return lazy
        return cls([replicas.latent(i, layer) for i, layer in enumerate(cache.layers)],
                   replicas.rotary)

    def place_sinks(self, positions: torch.Tensor) -> None:
        """Where each row's first token sits (``(b,)``, after its left padding): what stores
        that keep a sink keep in full precision (``stores.vector``); layers added later (a
        lazily built cache) get them too."""
        self.sink_positions = positions
        for layer in self.layers:
            if isinstance(layer, (LatentDynamicLayer, LatentStaticLayer)):
                layer.place_sinks(positions)

    def mark_dynamic(self) -> None:
        """Mark every axis of the cache that grows with the tokens dynamic (each dynamic
        layer's windows and codes, a growing RoPE angle log), so a compiled decode step
        traces one graph for every length (``LatentDynamicLayer.mark_dynamic``)."""
        for layer in self.layers:
            if isinstance(layer, LatentDynamicLayer):
                layer.mark_dynamic()
        if self.rotary is not None and self.rotary.max_cache_len is None:
            for tensor in self.rotary.tensors():
                if tensor.shape[1] > 1:
                    torch._dynamo.maybe_mark_dynamic(tensor, 1)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: keys, values, RoPE angles; codes, scales, zero
        points, sinks and full-precision windows (a static layer's whole allocation)."""
        tensors = [t for layer in self.layers
                   for t in (layer.tensors() if isinstance(layer, LatentLayer) or is_coded(layer)
                             else (getattr(layer, "keys", None), getattr(layer, "values", None)))]
        tensors += self.rotary.tensors() if self.rotary is not None else []
        return [t for t in tensors if isinstance(t, torch.Tensor)]

    def cache_bytes(self) -> int:
        """Bytes held by the cache's tensors, measured."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def cache_bits(self, float_bits: int = STORED_FLOAT_BITS) -> int:
        """Bits held by the cache's tensors, measured, every floating tensor counted at
        ``float_bits`` bits per element (16: its size in a 16-bit deployment, what
        ``Plan.bits_per_value`` counts) and integer ones (packed codes) as they are."""
        return sum(t.numel() * (float_bits if t.is_floating_point() else 8 * t.element_size())
                   for t in self._tensors())

    def cached_values(self) -> int:
        """Full K/V values the cache stands for: per layer, batch × tokens × the K and V
        widths (a latent side's basis width, a raw side's heads × head dim); a static
        layer counts its whole allocation, as ``cache_bytes`` does."""
        total = 0
        for layer in self.layers:
            if is_coded(layer):
                total += layer.cached_values()
                continue
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor) \
                    or keys.dim() != 4:
                continue
            if not isinstance(layer, LatentLayer):
                total += keys.numel() + values.numel()
                continue
            tokens = (getattr(layer, "ring", layer.max_cache_len) if isinstance(layer, StaticLayer)
                      else layer.k_store.tokens(layer.keys))
            for basis, stored in ((layer.bases.k_basis, keys), (layer.bases.v_basis, values)):
                width = basis.shape[1] if basis is not None else stored.shape[1] * stored.shape[3]
                total += stored.shape[0] * tokens * width
        return total

    def bits_per_value(self) -> float:
        """Bits per cached K/V value, measured from the tensors (``cache_bits`` ÷
        ``cached_values``); 0.0 for an empty cache."""
        values = self.cached_values()
        return self.cache_bits() / values if values else 0.0


def _rotary_log(bases: dict[int, LatentCodec], max_cache_len: int | None) -> RotaryLog | None:
    """The RoPE angle log the layers caching keys before RoPE share, if any does."""
    styles = {(b.rope_style, b.rotary_dim, b.rope_turn) for b in bases.values() if b.rope_style}
    if not styles:
        return None
    style, rotary_dim, turn = styles.pop()
    return RotaryLog(style, max_cache_len, rotary_dim, turn)


class _LatentReplicas:
    """Each cache layer's latent counterpart where ``bases`` covers its index: what
    :meth:`LatentCache.from_codecs` swaps in layer by layer, and, as a lazily built cache's
    ``layer_class_to_replicate`` (``build``: the class's own, ``cache``: that cache), the layer
    ``Cache.update`` adds next. The first layer caching keys before RoPE owns the angle log."""

    def __init__(self, bases: dict[int, LatentCodec], codes: dict[int, SideCodes],
                 prefill_as_stored: bool, rotary: RotaryLog | None):
        self.bases, self.codes, self.rotary = bases, codes, rotary
        self.prefill_as_stored = prefill_as_stored
        self.log_owner: int | None = None
        self.build = self.cache = None

    def replicate_for(self, cache: "LatentCache") -> None:
        """Become ``cache``'s ``layer_class_to_replicate``, building what it built before."""
        self.build, self.cache = cache.layer_class_to_replicate, cache
        cache.layer_class_to_replicate = self

    def __call__(self):
        layer = self.latent(len(self.cache.layers), self.build())
        if self.cache.sink_positions is not None and hasattr(layer, "place_sinks"):
            layer.place_sinks(self.cache.sink_positions)
        return layer

    def latent(self, i: int, layer):
        """Layer ``i`` of a fresh cache, ``layer``, or its latent counterpart."""
        k_code, v_code = self.codes.get(i, (None, None))
        kind = type(layer)
        sliding = kind is StaticSlidingWindowLayer or kind in _SLIDING_LAYERS
        if i in self.bases and sliding and VectorBook in (type(k_code), type(v_code)):
            raise ValueError(f"layer {i}: a sliding-window layer cannot hold vector codes")
        states = {"number_of_states": layer.number_of_states} \
            if isinstance(layer, LinearAttentionLayer) else {}
        if i not in self.bases:
            pass
        elif codes_own_states(kind) and k_code is not None:
            layer = coded(layer, k_code)
        elif kind is StaticSlidingWindowLayer and any(
                x is not None for x in (k_code, v_code, self.bases[i].k_basis,
                                        self.bases[i].v_basis)):
            layer = LatentStaticSlidingLayer(layer.max_cache_len, layer.max_cache_len,
                                             self.bases[i], k_code, v_code)
        elif kind in _SLIDING_LAYERS:
            layer = _SLIDING_LAYERS[kind](layer.sliding_window, self.bases[i], k_code, v_code,
                                          **states)
        elif kind is StaticLayer or kind in _FULL_LAYERS:
            b = self.bases[i]
            if b.rope_style:
                b = replace(b, rotary=self.rotary)
                self.log_owner = i if self.log_owner is None else self.log_owner
            owns = self.log_owner == i
            layer = (LatentStaticLayer(layer.max_cache_len, b, k_code, v_code, owns)
                     if kind is StaticLayer
                     else _FULL_LAYERS[kind](b, k_code, v_code, owns, **states))
        elif isinstance(layer, StaticLayer) and kind is not StaticSlidingWindowLayer:
            raise ValueError(f"layer {i}: transformers' {kind.__name__} has no static "
                             "latent counterpart yet: generate this model with the dynamic "
                             "cache (cache_implementation='dynamic')")
        if self.prefill_as_stored and hasattr(layer, "prefill_as_stored"):  # a latent one
            layer.prefill_as_stored = True
        return layer


@functools.cache
def _latent_class(own: type[Cache]) -> type[LatentCache]:
    """``own`` (a cache class that adds its layers lazily) with :class:`LatentCache` mixed in:
    the model's class first, so its methods and state (MiniMax's linear-attention states, its
    batch reordering) stay as it defines them; ``own()`` initialises ``LatentCache`` through
    ``Cache.__init__``'s keywords."""
    return type(f"Latent{own.__name__}", (own, LatentCache), {"__module__": __name__})
