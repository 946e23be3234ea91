"""What transformers' own cache holds for a model, read off one short forward: its class, the
layers that hold keys and values, their classes and shapes. No graph, no module names: this
is all a plain plan needs of a layer the analysis declines (issue #36), since coding what a
cache layer stores changes nothing of how attention computes it; and which cache layer each
attention block writes where no module says (a shared attention block, as Zamba's)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from .capture import synthetic_input_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedLayer:
    """One cache layer (of class ``kind``) holding keys ``(b, kv_heads, n, k_head_dim)`` and
    values ``(b, kv_heads, n, v_head_dim)``."""

    layer: int
    kind: type
    kv_heads: int
    k_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class CacheProbe:
    """The cache a model's forward builds for itself (``cache_class``: ``DynamicCache``, or
    the model's own, as MiniMax's) and its layers that hold keys and values."""

    cache_class: type | None
    layers: list[CachedLayer]


@torch.no_grad()
def own_cache_class(model: nn.Module) -> type[DynamicCache] | None:
    """The cache class of a model that caches in a class of its own, where lorc_fx can build
    one: ``generate`` builds no cache for the model (``_supports_default_dynamic_cache``), a
    forward without one builds a ``DynamicCache`` subclass, and that class builds with no
    arguments a cache that adds transformers' ``DynamicLayer`` as each is first written (as
    MiniMax's; the latent cache adds latent layers instead). ``None`` otherwise
    (transformers' ``DynamicCache`` serves, or nothing lorc_fx can build does).
    Found once per model (one short forward) and kept on it."""
    if "_lorc_own_cache" not in vars(model):
        own = None
        supports_default = getattr(type(model), "_supports_default_dynamic_cache", None)
        if supports_default is not None and not supports_default():
            probe = probe_cache(model)
            cls = None if probe is None else probe.cache_class
            if cls is not None and issubclass(cls, DynamicCache) and cls is not DynamicCache \
                    and _builds_lazily(cls):
                own = cls
        vars(model)["_lorc_own_cache"] = own
    return vars(model)["_lorc_own_cache"]


def _builds_lazily(cls: type[DynamicCache]) -> bool:
    try:
        fresh = cls()
    except Exception:  # noqa: BLE001  (a class needing arguments: lorc_fx cannot build it)
        return False
    return not fresh.layers and fresh.layer_class_to_replicate is DynamicLayer


def fresh_cache(model: nn.Module) -> DynamicCache:
    """An empty cache for ``model``'s forward: its own class (:func:`own_cache_class`) where it
    has one, else transformers' ``DynamicCache`` of its config."""
    own = own_cache_class(model)
    if own is not None:
        return own()
    return DynamicCache(config=model.config.get_text_config(decoder=True))


@torch.no_grad()
def probe_cache(model: nn.Module) -> CacheProbe | None:
    """The cache a forward of ``model`` over a few tokens fills: a ``DynamicCache`` of its
    config, as ``generate`` builds, or where the model refuses one, the cache the model
    builds for itself (``use_cache=True``, none passed); ``None`` where the model has no
    transformers config or neither forward runs (nothing is known)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return None
    ids = synthetic_input_ids(model, 2)
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    try:
        model(ids, past_key_values=cache, use_cache=True)
    except Exception:  # noqa: BLE001  (any model: perhaps one with a cache class of its own)
        try:
            cache = model(ids, use_cache=True).past_key_values
        except Exception as err:  # noqa: BLE001  (then nothing is known of its cache)
            log.info("lorc_fx: a forward with transformers' cache failed (%r)", err)
            return None
    found = []
    for i, layer in enumerate(getattr(cache, "layers", [])):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) \
                or keys.dim() != 4 or values.dim() != 4 or keys.shape[1] != values.shape[1]:
            continue
        found.append(CachedLayer(i, type(layer), keys.shape[1], keys.shape[3], values.shape[3]))
    return CacheProbe(None if cache is None else type(cache), found)
