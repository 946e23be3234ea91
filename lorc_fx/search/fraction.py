"""The smallest cache fraction whose held-out calibration loss stays within a quality target.

``compress(model, max_ppl_increase=t)`` asks for the smallest cache that costs at most a
factor ``1 + t`` of perplexity on held-out calibration windows (the windows the split search
measures on; the uncompressed model's loss on them is the reference). The loss falls as the
fraction grows, and at 1.0 the cache is exact, so the target is met at the top of the grid
and a bisection over ``FRACTION_STEP`` fractions finds the boundary with ~log2(grid) plans.

Invariant: the chosen fraction was measured to meet the target (or is 1.0, exact by
construction); a fraction the schedule cannot reach counts as missing it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

FRACTION_STEP = 0.05
LEAST_FRACTION = 0.1  # below it no plan of any model measured here was usable


@dataclass
class FractionSearch:
    """What the search measured: held-out calibration perplexity ratio (compressed ÷ full)
    per fraction planned (``inf`` where the schedule cannot reach it), and the choice."""

    max_ppl_increase: float
    chosen: float = 1.0
    ratios: dict[float, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"max_ppl_increase": self.max_ppl_increase, "chosen_fraction": self.chosen,
                "ppl_ratio": self.ratios.get(self.chosen, 1.0),
                "measured": {f"{f:.2f}": r for f, r in sorted(self.ratios.items())}}


def fraction_grid() -> list[float]:
    """Fractions from ``LEAST_FRACTION`` to 1.0 in steps of ``FRACTION_STEP``, ascending."""
    count = round((1.0 - LEAST_FRACTION) / FRACTION_STEP)
    return [round(LEAST_FRACTION + i * FRACTION_STEP, 6) for i in range(count + 1)]


def smallest_fraction(loss_at: Callable[[float], float], full_loss: float,
                      max_ppl_increase: float,
                      progress: Callable[[], None] = lambda: None) -> FractionSearch:
    """Bisect :func:`fraction_grid` for the smallest fraction whose held-out loss
    ``loss_at(f)`` (``inf`` where unreachable) is within ``log(1 + max_ppl_increase)`` of
    ``full_loss``; ``progress`` is called after every measurement."""
    search = FractionSearch(max_ppl_increase)
    grid = fraction_grid()
    bound = full_loss + math.log1p(max_ppl_increase)
    lo, hi = -1, len(grid) - 1  # grid[hi] meets the target (1.0: exact); grid[lo] misses it

    while hi - lo > 1:
        mid = (lo + hi) // 2
        loss = loss_at(grid[mid])
        search.ratios[grid[mid]] = math.exp(loss - full_loss) if math.isfinite(loss) else math.inf
        progress()
        if loss <= bound:
            hi = mid
        else:
            lo = mid
    search.chosen = grid[hi]
    return search


def bisection_steps() -> int:
    """How many fractions :func:`smallest_fraction` measures at most (for a progress bar)."""
    return math.ceil(math.log2(len(fraction_grid())))
