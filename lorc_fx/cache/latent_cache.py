"""``LatentCache``: a transformers ``Cache`` of latent layers where a plan compresses a
layer and the given layers elsewhere."""
from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicLayer,
                                     StaticLayer, get_layer_types_and_kwargs)

from lorc_fx.plan.options import SCALE_BITS, STORED_FLOAT_BITS
from lorc_fx.plan.planner import Plan

from .layers import LatentCodec, LatentDynamicLayer, LatentStaticLayer
from .quantize import ChannelSplit, QuantSpec
from .quantized_layers import QuantizedLatentDynamicLayer
from .quantized_static import QuantizedLatentStaticLayer
from .rotary import RotaryLog
from .vector_codes import VectorBook
from .vector_layers import VectorCodedLatentLayer

# (keys, values); None: not quantized; keys of a keys_waterfilled plan: a split of widths
SideSpecs = tuple[QuantSpec | ChannelSplit | None, QuantSpec | None]
# (keys, values) of a vector plan's layer; None: that side not coded
SideBooks = tuple[VectorBook | None, VectorBook | None]


def codecs(plan: Plan) -> dict[int, LatentCodec]:
    """The codec of every layer the plan does not skip, by layer index. A plain plan's
    identity bases are not applied: its cache stores the keys and values themselves."""
    if plan.kind == "plain":
        return {l.layer: LatentCodec(None, None, l.num_kv_heads) for l in plan.layers
                if not l.skipped}
    return {l.layer: LatentCodec.of(l) for l in plan.layers if not l.skipped}


def scale_dtype(plan: Plan) -> torch.dtype | None:
    """What quantization scales and zero points are stored in: 16 bits (``SCALE_BITS``), the
    model's own dtype where it has 16 bits (``None``), else float16."""
    return None if plan.dtype_bits == SCALE_BITS else torch.float16


def side_specs(plan: Plan) -> dict[int, SideSpecs]:
    """How each layer's sides are stored (``Plan.side_groups``): latents per channel over
    groups of ``latent_group`` tokens, a plain plan's values per token, a keys_waterfilled
    plan's keys in runs of their own widths; 16-bit scales (:func:`scale_dtype`). Empty where
    nothing is quantized."""
    bits = plan.options.latent_bits
    if bits == 16:
        return {}
    out, scales = {}, scale_dtype(plan)
    for layer in plan.layers:
        (k_group, k_axis), (v_group, v_axis) = plan.side_groups(layer)
        make = lambda group, axis: (None if group is None
                                    else QuantSpec(bits, group, axis, scales))
        keys = (ChannelSplit(layer.k_bit_runs, k_group, scales)
                if layer.k_bit_runs and k_group else make(k_group, k_axis))
        specs = (keys, make(v_group, v_axis))
        if specs != (None, None):
            out[layer.layer] = specs
    return out


def side_books(plan: Plan) -> dict[int, SideBooks]:
    """The books of each layer a vector plan codes (empty for other plans)."""
    if plan.kind != "vector":
        return {}
    return {l.layer: (l.k_book, l.v_book) for l in plan.layers
            if not l.skipped and (l.k_book is not None or l.v_book is not None)}


def layers_kept_as_built(config) -> dict[int, str]:
    """The cache layers a :class:`LatentCache` leaves as transformers builds them for this
    model config (sliding-window, chunked, linear attention, ...): index → layer type. Only
    plain full-attention layers are swapped for latent ones, so a plan must count these full."""
    if config is None:
        return {}
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return {i: kind for i, kind in enumerate(layer_types)
            if DYNAMIC_LAYER_TYPE_MAPPING.get(kind) is not DynamicLayer}


class LatentCache(Cache):
    """Latent layers where a plan compresses a layer, the given layers elsewhere."""

    def __init__(self, layers: list, rotary: RotaryLog | None = None):
        super().__init__(layers=layers)
        self.rotary = rotary

    @classmethod
    def from_cache(cls, cache: Cache, plan: Plan) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``plan`` compresses
        (sides quantized as ``plan.options.latent_bits`` / ``latent_group`` say, or coded by
        a vector plan's books)."""
        return cls.from_codecs(cache, codecs(plan), side_specs(plan), side_books(plan))

    @classmethod
    def from_codecs(cls, cache: Cache, bases: dict[int, LatentCodec],
                    quant: dict[int, SideSpecs] | None = None,
                    books: dict[int, SideBooks] | None = None) -> "LatentCache":
        """Swap each plain dynamic/static layer of a fresh ``cache`` that ``bases`` covers;
        a layer with ``quant`` specs stores those sides quantized
        (:class:`QuantizedLatentDynamicLayer`, :class:`QuantizedLatentStaticLayer`), one with
        ``books`` codes them (:class:`VectorCodedLatentLayer`; dynamic caches only)."""
        static = [l for l in cache.layers if type(l) is StaticLayer]
        quant, books = quant or {}, books or {}
        if static and books:
            raise ValueError("vector-coded latents (a plan of kind 'vector') need a dynamic "
                             "cache: a static cache (cache_implementation='static') is not "
                             "supported for them")
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
                if type(layer) is StaticLayer and i in quant:
                    layer = QuantizedLatentStaticLayer(layer.max_cache_len, b, *quant[i], owns)
                elif type(layer) is StaticLayer:
                    layer = LatentStaticLayer(layer.max_cache_len, b, owns)
                elif i in books:
                    layer = VectorCodedLatentLayer(b, *books[i], owns)
                elif i in quant:
                    layer = QuantizedLatentDynamicLayer(b, *quant[i], owns)
                else:
                    layer = LatentDynamicLayer(b, owns)
            layers.append(layer)
        return cls(layers, rotary)

    def place_sinks(self, positions: torch.Tensor) -> None:
        """Where each row's first token sits (``(b,)``, after its left padding): what the
        vector-coded layers keep in full precision (``VectorCodedLatentLayer.place_sinks``);
        other layers keep every token as it is."""
        for layer in self.layers:
            if isinstance(layer, VectorCodedLatentLayer):
                layer.place_sinks(positions)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: keys, values, RoPE angles; quantized latents' codes,
        scales, zero points and full-precision windows (a static layer's whole allocation)."""
        tensors = [t for layer in self.layers
                   for t in (layer.tensors() if isinstance(layer, (QuantizedLatentDynamicLayer,
                                                                   QuantizedLatentStaticLayer,
                                                                   VectorCodedLatentLayer))
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
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not getattr(layer, "is_initialized", False) or not isinstance(keys, torch.Tensor) \
                    or keys.dim() != 4:
                continue
            bases = getattr(layer, "bases", None)
            if bases is None:
                total += keys.numel() + values.numel()
                continue
            tokens = layer.max_cache_len if isinstance(layer, StaticLayer) else layer.get_seq_length()
            for basis, stored in ((bases.k_basis, keys), (bases.v_basis, values)):
                width = basis.shape[1] if basis is not None else stored.shape[1] * stored.shape[3]
                total += stored.shape[0] * tokens * width
        return total

    def bits_per_value(self) -> float:
        """Bits per cached K/V value, measured from the tensors (``cache_bits`` ÷
        ``cached_values``); 0.0 for an empty cache."""
        values = self.cached_values()
        return self.cache_bits() / values if values else 0.0
