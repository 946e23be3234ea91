"""Bits per key latent channel by reverse water-filling: the ``keys_waterfilled`` plan.

A key latent's rows are a data-aware basis, most energy first, so storing every row at one
width (and cutting the rank to the budget) spends bits where they buy little. Transform
coding's answer is to give each row the width its share of the error buys (dropping a row is
the 0-bit case). Row ``c`` at width ``b`` is modelled to cost ``e_c·ρ_c(b)``: ``e_c`` its
spectrum energy (the error of dropping it, in the planner's one unit across layers),
``ρ_c(b)`` its relative squared rounding error, measured on calibration latents
(``search.key_bits``), ``ρ_c(0) = 1``. Stored per channel over groups of ``G`` tokens it costs
``b + 2·16/G`` bits a token (codes, 16-bit scale and zero point). Greedy descent over each
row's lower convex hull of (bits, error), all rows of all layers together, spends the keys'
budget where the error falls fastest.

Values stay KIVI's (per token, ``options.latent_bits`` bits in groups of
``options.latent_group`` channels of a head; identity basis) and keys are cached before RoPE
(the angle log counted), as measured best at 4.5 bits per value on the planner's held-out
windows (bench/results/bit_waterfill-cpu.md): keys water-filled over widths 3/4/8 in groups
of 256 tokens beside 4-bit values.

Invariants of the plan: each layer's key basis holds the rows it keeps, reordered into runs of
one width, widest first (``LayerPlan.k_bit_runs``); its bytes are the budget's or fewer;
no compressed layer drops every key row.
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from itertools import groupby

import torch

from .options import SCALE_BITS, STORED_FLOAT_BITS, PlanOptions
from .planner import LayerPlan, Plan, value_token_group
from .schedules import UnreachableFraction

KEY_WIDTHS = (3, 4, 8)  # code widths a key row may take (besides dropped)
KEY_GROUP = 256  # tokens per scale and zero point of a key row


def _hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """The lower convex hull of ``(cost, error, bits)`` points from the first (0 bits), error
    falling as the cost rises: the steps greedy descent may take."""
    hull = [points[0]]
    for p in sorted(points[1:]):
        if p[1] >= hull[-1][1]:
            continue
        while len(hull) >= 2 and ((hull[-1][1] - p[1]) * (hull[-1][0] - hull[-2][0])
                                  >= (hull[-2][1] - hull[-1][1]) * (p[0] - hull[-1][0])):
            hull.pop()
        hull.append(p)
    return hull


def allocate(energies: list[torch.Tensor], rho: list[dict[int, torch.Tensor]], budget: float,
             widths: tuple[int, ...], group: int) -> list[list[int]]:
    """Bits per row of each layer (``energies[l]``: ``(r,)``; ``rho[l][b]``: ``(r,)``
    relative rounding errors at width ``b``) spending at most ``budget`` bits per token."""
    over = 2 * SCALE_BITS / group
    hulls = [_hull([(0.0, float(e[c]), 0)]
                   + [(b + over, float(e[c] * r[b][c]), b) for b in widths])
             for e, r in zip(energies, rho) for c in range(len(e))]
    step = [0] * len(hulls)
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        h, s = hulls[i], step[i]
        if s + 1 < len(h):
            heapq.heappush(heap, (-(h[s][1] - h[s + 1][1]) / (h[s + 1][0] - h[s][0]), i))

    for i in range(len(hulls)):
        push(i)
    spent = 0.0
    while heap:
        _, i = heapq.heappop(heap)
        extra = hulls[i][step[i] + 1][0] - hulls[i][step[i]][0]
        if spent + extra > budget + 1e-9:
            continue  # this row's next step does not fit; cheaper steps of others may
        spent += extra
        step[i] += 1
        push(i)
    flat = iter(hulls[i][step[i]][2] for i in range(len(hulls)))
    return [[next(flat) for _ in range(len(e))] for e in energies]


def _keys(layer: LayerPlan, bits: list[int], energy: torch.Tensor, group: int) -> LayerPlan:
    """``layer`` keeping its key rows of nonzero ``bits``, widest first."""
    order = sorted((c for c, b in enumerate(bits) if b), key=lambda c: -bits[c])
    runs = tuple((len(list(rows)), b) for b, rows in groupby(bits[c] for c in order))
    index = torch.tensor(order, dtype=torch.long)
    total = float(energy.sum())
    return replace(layer, k_rank=len(order), k_basis=layer.k_basis[index],
                   k_rebuild=layer.k_rebuild[index], k_bit_runs=runs, k_group=group,
                   k_energy_kept=float(energy[index].sum()) / total if total > 0 else 1.0)


def _plain_values(layer: LayerPlan) -> LayerPlan:
    """``layer`` caching its values themselves (an identity basis), as plain quantization."""
    eye = torch.eye(layer.v_full, dtype=torch.float64)
    return replace(layer, v_rank=layer.v_full, v_basis=eye, v_rebuild=eye, v_energy_kept=1.0)


def keys_waterfilled_plan(full: Plan, energies: list[torch.Tensor],
                          rho: list[dict[int, torch.Tensor]], options: PlanOptions,
                          widths: tuple[int, ...] = KEY_WIDTHS, group: int = KEY_GROUP) -> Plan:
    """The ``keys_waterfilled`` plan at ``options``' budget from ``full``, a full-rank plan
    (keys before RoPE where the model has RoPE; its layers' key rows in the order of
    ``energies``), and the rows' rounding errors ``rho`` (per layer of ``full``, per width of
    ``widths``, per row) in groups of ``group`` tokens."""
    if options.latent_bits == 16:
        raise ValueError("keys water-filled beside quantized values need latent_bits 8 or 4")
    budget, float_bits = options.budget(full.dtype_bits)
    values_per_token, _ = full.cache_elements_per_token()
    fixed = full.rotary_log * float_bits  # bits a token of everything but the key codes
    for l in full.layers:
        fixed += l.k_full * float_bits if l.skipped or not l.k_compressible else 0
        value_bits = options.latent_bits + 2 * SCALE_BITS / value_token_group(
            l.head_dim, options.latent_group)
        fixed += l.v_full * (float_bits if l.skipped or not l.v_compressible else value_bits)
    picked = [i for i, l in enumerate(full.layers) if not l.skipped and l.k_compressible]
    if not picked:
        raise UnreachableFraction("keys water-filled: no layer caches key latents (keys behind "
                                  "a norm or layers kept full)", 0.0)
    keys = budget * values_per_token - fixed
    if keys <= 0:
        raise UnreachableFraction("keys water-filled beside quantized values: the values alone "
                                  "fill the budget", 0.0)
    bits = allocate([energies[i] for i in picked], [rho[i] for i in picked], keys, widths,
                    group)
    layers = [l if l.skipped or not l.v_compressible else _plain_values(l) for l in full.layers]
    for i, b in zip(picked, bits):
        if not any(b):
            raise UnreachableFraction(f"keys water-filled: the budget leaves layer "
                                      f"{layers[i].layer} no key row", 0.0)
        layers[i] = _keys(layers[i], b, energies[i], group)
    plan = replace(full, layers=layers, options=options, kind="keys_waterfilled")
    plan.reachable = (plan.size_as_asked,
                      STORED_FLOAT_BITS if options.bits_per_value is not None else 1.0)
    return plan
