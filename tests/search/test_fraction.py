"""``max_ppl_increase``: the smallest cache fraction within a perplexity target on held-out
calibration windows (``lorc_fx.search.fraction``)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

import lorc_fx
from lorc_fx.plan.options import PlanOptions
from lorc_fx.search.fraction import bisection_steps, fraction_grid, smallest_fraction
from lorc_fx.search.split import calibration_loss, held_out_loss, held_out_windows


@given(boundary=st.integers(0, len(fraction_grid()) - 1), unreachable=st.integers(0, 5),
       target=st.floats(0.001, 1.0))
def test_bisection_finds_the_boundary_of_a_falling_loss(boundary, unreachable, target):
    """Losses above the target below ``boundary``, within it from there, ``inf`` where the
    schedule cannot reach: the search picks the boundary, measures its lower neighbour, and
    never more than ``bisection_steps`` fractions."""
    grid = fraction_grid()
    bound = math.log1p(target)
    calls = []

    def loss_at(f):
        calls.append(f)
        i = grid.index(f)
        if i < unreachable:
            return math.inf
        return bound * (0.5 if i >= boundary else 1.5 + (boundary - i))

    search = smallest_fraction(loss_at, 0.0, target)
    assert search.chosen == grid[max(boundary, min(unreachable, len(grid) - 1))]
    assert len(calls) == len(set(calls)) <= bisection_steps()
    chosen = grid.index(search.chosen)
    if chosen > 0:
        assert search.ratios[grid[chosen - 1]] > 1 + target
    if search.chosen < 1.0:
        assert search.ratios[search.chosen] <= 1 + target


@pytest.mark.parametrize("target, fraction, message", [
    (0, None, "max_ppl_increase must be a number in (0, 10]"),
    (-0.1, None, "max_ppl_increase must be a number in (0, 10]"),
    (True, None, "max_ppl_increase must be a number"),
    ("2%", None, "max_ppl_increase must be a number"),
    (0.02, 0.6, "give cache_fraction or max_ppl_increase, not both"),
])
def test_bad_targets_are_refused_by_name(target, fraction, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PlanOptions(cache_fraction=fraction, max_ppl_increase=target)


def test_compress_refuses_a_bad_target_before_analysing(monkeypatch):
    monkeypatch.setattr(lorc_fx.api, "analyze", lambda m: pytest.fail("analysed"))
    with pytest.raises(ValueError, match="not both"):
        lorc_fx.compress(object(), 0.5, max_ppl_increase=0.02)


def test_compress_to_a_target_keeps_the_least_fraction_that_meets_it(loaded):
    model, tok, blocks, text = loaded
    target = 0.003  # between the tiny model's ratios at 0.25 and 0.5
    report = lorc_fx.compress(model, max_ppl_increase=target, basis="attention",
                              rope="commute", blocks=blocks)
    search = report.plan.fraction_search
    chosen = search["chosen_fraction"]
    assert report.plan.options.cache_fraction == pytest.approx(chosen)
    # the recorded ratio is the chosen plan's, measured again here on the same windows
    windows = held_out_windows(model, report.plan.options)
    full = calibration_loss(model, blocks, None, windows)
    ratio = math.exp(held_out_loss(model, blocks, report.plan) - full)
    assert ratio == pytest.approx(search["ppl_ratio"], rel=1e-6)
    assert ratio <= 1 + target
    below = f"{chosen - 0.05:.2f}"
    assert chosen == 0.1 or search["measured"][below] > 1 + target
    assert f"fraction: {chosen:.2f} requested, the smallest" in str(report)
