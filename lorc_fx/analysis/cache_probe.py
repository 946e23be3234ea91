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
from transformers.cache_utils import DynamicCache

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
