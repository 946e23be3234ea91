"""Model-level entry points: analyse a model's attention, then plan its ranks."""
from __future__ import annotations

from torch import nn

from .bases import BASES
from .blocks import AttentionBlock, named_params
from .layers import layer_inputs
from .plan import Plan, PlanOptions, plan_layers


def plan(model: nn.Module, cache_fraction: float = 0.6, *, schedule: str = "progressive",
         rope: str = "commute", basis: str = "weight", skip_threshold: float | None = None,
         keep_first: int = 0, rank_multiple: int = 8,
         blocks: list[AttentionBlock] | None = None) -> Plan:
    """Per-layer LoRC ranks and bases for ``model`` keeping ``cache_fraction`` of its K/V cache.

    ``blocks`` defaults to :func:`lorc_fx.analyze` of the model.
    """
    options = PlanOptions(cache_fraction=cache_fraction, schedule=schedule, rope=rope,
                          basis=basis, skip_threshold=skip_threshold, keep_first=keep_first,
                          rank_multiple=rank_multiple)
    if blocks is None:
        from .analysis import analyze
        blocks = analyze(model)
    grams = BASES[basis](model, blocks)
    inputs = layer_inputs(named_params(model), blocks)
    for layer in inputs:
        layer.input_gram = grams.get(layer.layer)
    return plan_layers(inputs, options)
