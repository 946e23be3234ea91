"""Bits per latent row by reverse water-filling: transform coding's answer to "which width
does each row of a basis get", dropping a row the 0-bit case.

Row ``c`` at width ``b`` is modelled to cost ``e_c·ρ_c(b)``: ``e_c`` its weight (its spectrum
energy: the error of dropping it, in the planner's one unit across layers), ``ρ_c(b)`` its
relative squared coding error, measured on calibration latents, ``ρ_c(0) = 1``. Stored per
channel over groups of ``G`` tokens it costs ``b + 2·16/G`` bits a token (codes, 16-bit scale
and zero point; ``G`` infinite for codes without scales). Greedy descent over each row's lower
convex hull of (bits, error), all rows of all layers together, spends the budget where the
error falls fastest. Used by the ``keys_waterfilled`` and ``vector`` schemes
(``lorc_fx.schemes``, ``vector_allocation``).
"""
from __future__ import annotations

import heapq

import torch

from .options import SCALE_BITS


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
