"""Rank allocation from the spectra: water-filling on the error each dropped row causes.

Spectrum energies are errors in one unit across projections (``lorc_fx.metrics``), so
dropping rows where the error per latent dim is smallest, until the cache fraction is met,
minimises the total error of an additive model. Rows leave a spectrum from its tail in chunks
of ``rank_multiple``; the order in which chunks leave does not depend on the target, so ranks
never grow when the requested fraction shrinks.

Two schedules:

- ``greedy``: keys and values of all layers water-filled together;
- ``calibrated``: keys keep the same ratio in every layer, values are water-filled across
  layers. Measured on SmolLM2 (bench/quality.md): the first-order key error misjudges how
  layers compare, and trading it against the (exact to first order) value error compresses
  values too far, while the value error ranks layers well. The key/value split
  (``key_fraction``) is chosen by ``lorc_fx.split_search`` on calibration text; given no
  split, keys keep the requested fraction.
"""
from __future__ import annotations

import heapq
import math

from .schedules import SCHEDULES, Allocation, ScheduleInput, check_reachable, snap_rank
from .spectra import Spectrum


def _next_rank(spectrum: Spectrum, rank: int, multiple: int, least: int) -> int | None:
    """The largest valid rank below ``rank`` that is a multiple of ``multiple`` (or 0), and
    not below ``least``."""
    lower = [r for r in spectrum.valid_ranks if least <= r < rank and r % multiple == 0]
    return max(lower) if lower else None


def water_fill(spectra: list[Spectrum], movable: list[bool], keep: float,
               inp: ScheduleInput) -> list[int]:
    """Ranks for ``spectra`` keeping about ``keep`` rows in all: drop the chunk with the least
    error per dim, repeatedly, never below a side's least rank; stop at the state nearest
    ``keep`` (ties: keep more)."""
    ranks = [s.width for s in spectra]
    heap: list[tuple[float, int, int]] = []

    def push(i: int) -> None:
        lower = _next_rank(spectra[i], ranks[i], inp.rank_multiple, inp.least_rank(spectra[i]))
        if lower is not None:
            cost = float(spectra[i].energy[lower:ranks[i]].sum()) / (ranks[i] - lower)
            heapq.heappush(heap, (cost, i, lower))

    for i, m in enumerate(movable):
        if m:
            push(i)
    kept = sum(ranks)
    while heap and kept > keep:
        _, i, lower = heapq.heappop(heap)
        after = kept - (ranks[i] - lower)
        if after < keep and keep - after >= kept - keep:
            break  # stopping above the target is nearer
        kept, ranks[i] = after, lower
        push(i)
    return ranks


def _lowest(inp: ScheduleInput, spectra: list[Spectrum], movable: list[bool]) -> float:
    """The least fraction reachable: fixed sides full, movable ones at their least rank."""
    kept = sum(inp.least_rank(s) if m else s.width for s, m in zip(spectra, movable))
    return kept / inp.full_width


def greedy(inp: ScheduleInput) -> Allocation:
    """Keys and values of every layer water-filled together."""
    spectra = inp.k_spectra + inp.v_spectra
    movable = inp.compress_k + inp.compress_v
    lowest = _lowest(inp, spectra, movable)
    check_reachable(inp, lowest, "greedy")
    ranks = water_fill(spectra, movable, inp.cache_fraction * inp.full_width, inp)
    n = len(inp.k_spectra)
    return Allocation(list(zip(ranks[:n], ranks[n:])), lowest)


def key_ranks(inp: ScheduleInput, key_fraction: float, lo: float = 0.0,
              hi: float = 1.0) -> list[int]:
    """Every compressed layer's keys at ``key_fraction`` of their width, snapped inside
    ``[lo, hi]`` of it where a valid rank lies there (where values can make up the rest)."""
    return [snap_rank(s, key_fraction * s.width, inp.rank_multiple, hi,
                      max(inp.least_rank(s), math.ceil(lo * s.width - 1e-9)))
            if c else s.width
            for s, c in zip(inp.k_spectra, inp.compress_k)]


def feasible_key_fractions(k_widths: list[int], v_widths: list[int], compress_k: list[bool],
                           compress_v: list[bool], fraction: float,
                           v_least: list[int] | None = None) -> tuple[float, float]:
    """Key fractions for which values (from their least ranks, ``v_least``, to all kept) make
    up ``fraction``."""
    full = sum(k_widths) + sum(v_widths)
    k_width = sum(w for w, c in zip(k_widths, compress_k) if c)
    v_width = sum(w for w, c in zip(v_widths, compress_v) if c)
    v_floor = sum(r for r, c in zip(v_least or [0] * len(v_widths), compress_v) if c)
    if k_width == 0:
        return 1.0, 1.0
    target = fraction * full - (full - k_width - v_width)
    return (min(1.0, max(0.0, (target - v_width) / k_width)),
            min(1.0, max(0.0, (target - v_floor) / k_width)))


def calibrated(inp: ScheduleInput) -> Allocation:
    """Keys at one ratio in every layer (``inp.key_fraction``, else the cache fraction; moved
    into the range where values can make up the rest), values water-filled across layers
    with what remains."""
    lo, hi = feasible_key_fractions([s.width for s in inp.k_spectra],
                                    [s.width for s in inp.v_spectra], inp.compress_k,
                                    inp.compress_v, inp.cache_fraction,
                                    [inp.least_rank(s) for s in inp.v_spectra])
    wanted = inp.key_fraction if inp.key_fraction is not None else inp.cache_fraction
    keys = key_ranks(inp, min(max(wanted, lo), hi), lo, hi)
    lowest = _lowest(inp, inp.k_spectra + inp.v_spectra, inp.compress_k + inp.compress_v)
    check_reachable(inp, lowest, "calibrated")
    values = water_fill(inp.v_spectra, inp.compress_v,
                        inp.cache_fraction * inp.full_width - sum(keys), inp)
    return Allocation(list(zip(keys, values)), lowest)


SCHEDULES.update(greedy=greedy, calibrated=calibrated)
