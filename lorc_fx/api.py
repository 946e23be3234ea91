"""Model-level entry points: analyse a model's attention, then plan its ranks."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .bases import resolve
from .blocks import AttentionBlock, named_params
from .calibration import CalibrationOptions
from .layers import layer_inputs
from .plan import Plan, PlanOptions, plan_layers

# bases measured on calibration text; with them the calibrated schedule measures its split too
CALIBRATED_BASES = frozenset({"whitened", "attention"})


def plan(model: nn.Module, cache_fraction: float = 0.6, *, schedule: str = "calibrated",
         rope: str = "commute", basis: str = "auto", skip_threshold: float | None = None,
         keep_first: int = 0, rank_multiple: int = 8, key_fraction: float | None = None,
         calibration: CalibrationOptions | None = None,
         blocks: list[AttentionBlock] | None = None) -> Plan:
    """Per-layer LoRC ranks and bases for ``model`` keeping ``cache_fraction`` of its K/V cache.

    ``blocks`` defaults to :func:`lorc_fx.analyze` of the model. ``basis="auto"`` picks the
    best basis calibration allows (``lorc_fx.bases.resolve``); the plan's options record the
    basis used. ``calibration`` says which
    text the data-aware bases measure (default: :class:`CalibrationOptions`); measurements
    are cached on disk. With the ``calibrated`` schedule, a data-aware basis and no
    ``key_fraction``, the key/value split is measured too (``lorc_fx.split_search``).
    """
    options = PlanOptions(cache_fraction=cache_fraction, schedule=schedule, rope=rope,
                          basis=basis, skip_threshold=skip_threshold, keep_first=keep_first,
                          rank_multiple=rank_multiple, key_fraction=key_fraction,
                          calibration=calibration or CalibrationOptions())
    if blocks is None:
        from .analysis import analyze
        blocks = analyze(model)
    basis, metrics = resolve(basis, model, blocks, options)
    options = replace(options, basis=basis)
    inputs = layer_inputs(named_params(model), blocks)
    for layer in inputs:
        metric = metrics.get(layer.layer)
        if metric is not None:
            layer.input_gram = metric.input_gram
            layer.k_spectrum, layer.v_spectrum = metric.k_spectrum, metric.v_spectrum
    if options.schedule == "calibrated" and key_fraction is None and basis in CALIBRATED_BASES:
        from .split_search import measured_key_fraction
        options = replace(options, key_fraction=measured_key_fraction(model, blocks, inputs, options))
    return plan_layers(inputs, options)
