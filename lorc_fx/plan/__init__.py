"""The plan: per layer, the bases, ranks and codes a cache stores for a budget.

``options`` (what the user asks) → ``bases`` (which metric ranks a layer's rows, measured by
``calibration`` where it needs text) → ``spectra`` → ``schedules``/``allocation`` (how many
rows each layer keeps) → ``planner.plan_layers`` → :class:`Plan`, whose layers carry each
side's code (``planner.Code``) and which names its storage scheme (``scheme``; the schemes
themselves live in ``lorc_fx.schemes``).
"""
from .options import Budget, CalibrationOptions, PlanOptions
from .planner import LayerPlan, Plan, plan_layers
from .schedules import UnreachableFraction

__all__ = ["Budget", "CalibrationOptions", "LayerPlan", "Plan", "PlanOptions",
           "UnreachableFraction", "plan_layers"]
