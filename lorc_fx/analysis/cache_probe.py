"""What transformers' own cache holds for a model, read off one short forward: the layers
whose cache holds keys and values, their classes and shapes. No graph, no module names: this
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


@torch.no_grad()
def cached_layers(model: nn.Module) -> list[CachedLayer]:
    """The layers of ``model``'s transformers ``DynamicCache`` that hold keys and values
    (full-attention and sliding-window layers, alone or beside other state), with their
    classes and shapes, after one forward of a few tokens. Empty where the model has no
    transformers config or that forward fails."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return []
    try:
        cache = DynamicCache(config=config.get_text_config(decoder=True))
        model(synthetic_input_ids(model, 2), past_key_values=cache, use_cache=True)
    except Exception as err:  # noqa: BLE001  (any model: then there is nothing to code)
        log.info("lorc_fx: a forward with transformers' cache failed (%r)", err)
        return []
    found = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) \
                or keys.dim() != 4 or values.dim() != 4 or keys.shape[1] != values.shape[1]:
            continue
        found.append(CachedLayer(i, type(layer), keys.shape[1], keys.shape[3], values.shape[3]))
    return found
