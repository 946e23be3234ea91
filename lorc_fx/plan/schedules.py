"""Rank schedules: how many latent dims each layer keeps for a requested cache fraction.

A schedule sees only spectra and the layers' cumulative condition numbers; it returns
``(k_rank, v_rank)`` per layer. The ratio schedules (the paper's progressive formula and the
uniform baseline) share one solver: a single knob moves every layer's kept ratio
monotonically, and bisection on it meets the requested fraction within one rank step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .spectra import Spectrum


class UnreachableFraction(ValueError):
    """The requested cache fraction is outside what a schedule can produce; ``lowest`` is
    the least fraction it reaches on the model."""

    def __init__(self, message: str, lowest: float):
        super().__init__(message)
        self.lowest = lowest


@dataclass(frozen=True)
class ScheduleInput:
    k_spectra: list[Spectrum]
    v_spectra: list[Spectrum]
    log_kappa_cum: list[float]
    compress_k: list[bool]  # False: that layer's keys stay full width
    compress_v: list[bool]
    cache_fraction: float  # of the K/V widths, for latents (the plan pays its overhead first)
    rank_multiple: int
    key_fraction: float | None = None  # the calibrated schedule's key/value split
    overhead_fraction: float = 0.0  # what the cache holds besides latents, said in messages
    allow_zero_rank: bool = False  # may a side keep no latent at all (attention then ignores it)

    @property
    def full_width(self) -> int:
        return sum(k.width + v.width for k, v in zip(self.k_spectra, self.v_spectra))

    def fraction(self, ranks: list[tuple[int, int]]) -> float:
        return sum(k + v for k, v in ranks) / self.full_width

    def least_rank(self, spectrum: Spectrum) -> int:
        """The smallest rank a compressed side may keep: a layer whose keys or values keep no
        dim attends to nothing (every score equal, or every output zero), so unless the user
        allows it, one rank step (or the full width where no smaller valid rank exists)."""
        if self.allow_zero_rank:
            return 0
        steps = [r for r in spectrum.valid_ranks
                 if r > 0 and (r % self.rank_multiple == 0 or r == spectrum.width)]
        return min(steps, default=spectrum.width)


Ranks = list[tuple[int, int]]


@dataclass(frozen=True)
class Allocation:
    ranks: Ranks
    lowest_fraction: float  # the least cache fraction this schedule reaches on these layers


Schedule = Callable[[ScheduleInput], Allocation]


def snap_rank(spectrum: Spectrum, target: float, multiple: int, cap: float = 1.0,
              least: int = 0) -> int:
    """The valid rank nearest ``target`` that is a multiple of ``multiple`` (or full width),
    at least ``least`` and keeping at most ``cap`` of the width where it can."""
    allowed = [r for r in spectrum.valid_ranks
               if least <= r <= max(cap * spectrum.width + 1e-9, least)]
    candidates = [r for r in allowed if r % multiple == 0 or r == spectrum.width] or allowed
    return min(candidates, key=lambda r: (abs(r - target), -r))


def _ranks_at(inp: ScheduleInput, ratios: list[float]) -> Ranks:
    """Snap every layer's kept ratio to a valid rank, never keeping a larger share of the
    width than a shallower compressed layer (the spectra's valid ranks differ by layer, so
    snapping alone could break the ordering of non-increasing ratios)."""
    ranks, k_cap, v_cap = [], 1.0, 1.0
    for ks, vs, ck, cv, ratio in zip(inp.k_spectra, inp.v_spectra, inp.compress_k,
                                     inp.compress_v, ratios):
        k = (snap_rank(ks, ratio * ks.width, inp.rank_multiple, k_cap, inp.least_rank(ks))
             if ck else ks.width)
        v = (snap_rank(vs, ratio * vs.width, inp.rank_multiple, v_cap, inp.least_rank(vs))
             if cv else vs.width)
        k_cap = k / ks.width if ck else k_cap
        v_cap = v / vs.width if cv else v_cap
        ranks.append((k, v))
    return ranks


def check_reachable(inp: ScheduleInput, lowest: float, name: str) -> None:
    """Refuse a fraction more than one rank step below the least the schedule reaches."""
    step = inp.rank_multiple / inp.full_width
    if inp.cache_fraction < lowest - step:
        raise UnreachableFraction(
            f"cache fraction {inp.cache_fraction + inp.overhead_fraction:.3f} is out of reach "
            f"of the {name} schedule on this model: it reaches "
            f"[{lowest + inp.overhead_fraction:.3f}, 1.000] with the skipped layers kept; "
            "ask for a fraction in that range, or use another schedule",
            lowest + inp.overhead_fraction)


def solve_ratio_schedule(inp: ScheduleInput, ratios_at: Callable[[float], list[float]],
                         name: str) -> Allocation:
    """Bisect the knob ``m`` in [0, 1] (fraction non-decreasing in ``m``) to meet the target."""
    lowest = inp.fraction(_ranks_at(inp, ratios_at(0.0)))
    check_reachable(inp, lowest, name)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if inp.fraction(_ranks_at(inp, ratios_at(mid))) < inp.cache_fraction:
            lo = mid
        else:
            hi = mid
    return Allocation(_blend(inp, _ranks_at(inp, ratios_at(lo)), _ranks_at(inp, ratios_at(hi))),
                      lowest)


def _blend(inp: ScheduleInput, below: Ranks, above: Ranks) -> Ranks:
    """Step projections one at a time, shallow first, from ``below`` up to ``above`` while
    that brings the fraction closer to the target: the knob moves many projections at once,
    so on its own it lands only within one step of every projection it moves."""
    flat = [r for pair in below for r in pair]
    targets = [r for pair in above for r in pair]
    total = inp.full_width
    miss = lambda kept: abs(kept / total - inp.cache_fraction)
    kept = sum(flat)
    for i, up in enumerate(targets):
        if up == flat[i]:
            continue
        if miss(kept - flat[i] + up) > miss(kept):
            break  # a prefix of promotions keeps ranks monotone in depth
        kept += up - flat[i]
        flat[i] = up
    return list(zip(flat[0::2], flat[1::2]))


def progressive(inp: ScheduleInput) -> Allocation:
    """The paper's formula: kept ratio falls linearly in log κ̃ from 1 down to ``d_min/d_max``.

    ``min``/``max`` of log κ̃ are taken over the layers being compressed, so the most
    sensitive compressed layer keeps its full width and the least sensitive keeps ``d_min``.
    Where all compressed layers are equally sensitive (one layer, say) the formula is 0/0;
    they are then all least sensitive, which makes it the uniform schedule.
    """
    active = [lk for lk, ck, cv in zip(inp.log_kappa_cum, inp.compress_k, inp.compress_v)
              if ck or cv]
    top, bottom = (max(active), min(active)) if active else (0.0, 0.0)
    span = top - bottom
    fall = [(top - lk) / span if span > 0 else 1.0 for lk in inp.log_kappa_cum]
    return solve_ratio_schedule(inp, lambda m: [1 - f * (1 - m) for f in fall], "progressive")


def uniform(inp: ScheduleInput) -> Allocation:
    """The paper's baseline: every compressed layer keeps the same ratio."""
    return solve_ratio_schedule(inp, lambda m: [m] * len(inp.k_spectra), "uniform")


SCHEDULES: dict[str, Schedule] = {"progressive": progressive, "uniform": uniform}
