"""The rank plan: per-layer bases and ranks for a requested cache fraction.

``options`` (what the user asks) → ``bases`` (which metric ranks a layer's rows, measured by
``calibration`` where it needs text) → ``spectra`` → ``schedules``/``allocation`` (how many
rows each layer keeps) → ``planner.plan_layers`` → :class:`Plan`.
"""
from .options import CalibrationOptions, PlanOptions
from .planner import LayerPlan, Plan, plan_layers
from .schedules import UnreachableFraction

__all__ = ["CalibrationOptions", "LayerPlan", "Plan", "PlanOptions", "UnreachableFraction",
           "plan_layers"]
