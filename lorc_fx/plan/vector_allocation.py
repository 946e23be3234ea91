"""Bits per latent channel for product vector codes: the ``vector`` plan's allocation.

Every layer's keys (before RoPE) and values are latents of the full-rank calibrated basis,
channels most energy first. Channels are allocated in **tuples** of ``unit`` consecutive
channels, one width a tuple (a tuple is coded by sub-vectors of several channels, so its
channels share a width): tuple ``t`` at ``b`` bits a channel costs ``unit·b`` bits a token
(indices only: the tables are the model's) and leaves the error ``Σ_c e_c·ρ_c(b)`` over its
channels (``e_c`` the channel's weight: what the loss minds its relative error,
``plan.sensitivity``, or its spectrum energy in the planner's one unit; ``ρ_c(b)`` its
relative squared coding error measured on calibration latents, ``ρ(0) = 1``: dropped).
``bit_allocation.allocate`` (greedy descent on lower convex hulls) spends each side's budget.

Keys and values get separate budgets, the keys ``key_share`` of what the codes may spend:
the spectra's energies are one unit within a side but misjudge keys against values
(plan/allocation.py), and the sensitivities, a diagonal second-order model, misjudge them
too (one budget over both under a first version of them had a higher held-out loss at 1.92
bits than its best share, docs/schemes/vector.md); the share is measured
(``schemes.vector``).

Invariants: the allocation spends at most the budget; a channel's width is one the errors
were measured at, or 0.
"""
from __future__ import annotations

import math

import torch

from .bit_allocation import allocate
from .options import PlanOptions
from .planner import Plan, code_bits, vector_exact_share
from .schedules import UnreachableFraction

Errors = dict[float, torch.Tensor]  # width -> (r,) relative squared coding error per channel


def allocate_tuples(energies: list[torch.Tensor], rho: list[Errors], budget: float,
                    unit: int) -> list[list[float]]:
    """Bits per channel of each side (``energies[i]``: ``(r,)``, ``r`` a multiple of
    ``unit``) spending at most ``budget`` bits a token, ``unit`` consecutive channels at one
    width."""
    tuple_energy = [e.double().view(-1, unit).sum(1) for e in energies]
    tuple_rho = [{b: (e.double() * r[b].double()).view(-1, unit).sum(1) / te.clamp_min(1e-30)
                  for b in r} for e, r, te in zip(energies, rho, tuple_energy)]
    widths = tuple(sorted(rho[0]))
    per_tuple = allocate(tuple_energy, tuple_rho, budget / unit, widths, math.inf)
    return [[b for b in side for _ in range(unit)] for side in per_tuple]


def code_budget(full: Plan, options: PlanOptions) -> float:
    """Bits a token the codes may spend at ``options``' budget: the budget less the RoPE
    angle log, the sides not coded (as their plan stores them: a stored float's bits, or a
    sliding layer's plain codes) and every coded channel's floats (``vector_exact_share``:
    the sink, drift offsets, the recent window)."""
    budget, float_bits = options.budget.bits(full.dtype_bits)
    values, _ = full.cache_elements_per_token()
    fixed = full.rotary_log * float_bits
    coded = 0
    for l in full.layers:
        k_coded = not l.skipped and l.k_compressible
        v_coded = not l.skipped and l.v_compressible
        fixed += (0 if k_coded else code_bits(l.k_code, l.k_full, float_bits)) \
            + (0 if v_coded else code_bits(l.v_code, l.v_full, float_bits))
        coded += (l.k_full if k_coded else 0) + (l.v_full if v_coded else 0)
    held = fixed + coded * float_bits * vector_exact_share(options.drift_chunk,
                                                          options.recent_divisor)
    left = budget * values - held  # whatever the codes spend
    if left <= 0:
        lowest = options.budget.of_bits(held / values, full.dtype_bits)
        raise UnreachableFraction(
            f"vector codes: the sides they do not code, the RoPE angle log, the sinks, the "
            f"drift offsets and the recent window alone hold {lowest:.3f} "
            f"({options.budget.unit})", lowest)
    return left


def vector_bits(k_energies: list[torch.Tensor], v_energies: list[torch.Tensor],
                k_rho: list[Errors], v_rho: list[Errors], budget: float, key_share: float,
                unit: int) -> tuple[list[list[float]], list[list[float]]]:
    """(keys', values') bits per channel of each coded layer: the keys ``key_share`` of
    ``budget`` bits a token, the values the rest (and what the keys leave)."""
    if not 0 < key_share < 1:
        raise ValueError(f"key_share must be in (0, 1), not {key_share}")
    k_bits = allocate_tuples(k_energies, k_rho, key_share * budget, unit)
    spent = sum(sum(side) for side in k_bits)
    v_bits = allocate_tuples(v_energies, v_rho, budget - spent, unit)
    return k_bits, v_bits
