"""The bit-width search: candidates scored by held-out loss at one budget (issue #13)."""
import math

import pytest

from lorc_fx.api import compress
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import plan_layers
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.search.bits import Candidate, best_candidate, candidates, over_budget
from helpers.families import build, config_for
from helpers.plan_inputs import random_layers


def test_the_candidates_hold_plain_quantization_at_each_width_and_group():
    listed = candidates(["commute", "reconstruct"], (16, 8, 4), (32, 64), plain=True)
    assert {(c.latent_bits, c.latent_group) for c in listed if c.plain} == \
        {(8, 32), (8, 64), (4, 32), (4, 64)}
    assert {(c.rope, c.latent_bits, c.latent_group) for c in listed if not c.plain} == \
        {(m, 16, 32) for m in ("commute", "reconstruct")} | \
        {(m, b, g) for m in ("commute", "reconstruct") for b in (8, 4) for g in (32, 64)}
    # the first group of a width comes first: its measured split is reused by the others
    assert [c.latent_group for c in listed if c.latent_bits == 8 and not c.plain] == [32, 64] * 2
    assert not any(c.plain for c in candidates(["commute"], (16,), (32,), plain=False))
    # keys water-filled beside 4-bit values: right after the plain ones, where reconstruct
    # mode and 4 bits are searched
    (waterfilled,) = [c for c in listed if c.keys_waterfilled]
    assert listed.index(waterfilled) == 4 and waterfilled.rope == "reconstruct"
    assert (waterfilled.latent_bits, waterfilled.latent_group) == (4, 64)
    assert not any(c.keys_waterfilled for c in candidates(["commute"], (16, 8, 4), (32, 64), True))
    # vector codes after them (the caller plans them only where no plain candidate fits)
    (vector,) = [c for c in listed if c.vector]
    assert listed.index(vector) == 5 and vector.rope == "reconstruct"
    assert not any(c.vector for c in candidates(["commute"], (16, 8, 4), (32, 64), True))
    assert not any(c.vector for c in candidates(["reconstruct"], (4,), (32,), False))
    assert not any(c.keys_waterfilled for c in candidates(["reconstruct"], (16, 8), (64,), True))


def _plan(bits: int, budget: float = 8.0):
    return plan_layers(random_layers(0), PlanOptions(bits_per_value=budget, latent_bits=bits,
                                                     schedule="uniform", rank_multiple=4),
                       dtype_bits=16)


def test_the_least_loss_wins_and_every_measured_candidate_is_recorded():
    losses = {16: 3.0, 8: 2.5, 4: 2.75}
    listed = candidates(["commute"], (16, 8, 4), (32,), plain=False) + \
        [Candidate("commute", 4, plain=True)]

    def build(c):
        if c.plain:
            raise UnreachableFraction("no room", 9.0)
        return _plan(c.latent_bits), losses[c.latent_bits]

    best, loss = best_candidate(build, listed, progress=False)
    assert best.options.latent_bits == 8 and loss == 2.5
    assert [c["latent_bits"] for c in best.candidates] == [8, 4, 16]
    assert [c["loss"] for c in best.candidates] == [2.5, 2.75, 3.0]
    assert all(not c["plain"] for c in best.candidates)


def test_over_budget_candidates_are_left_out_and_no_plan_is_a_refusal():
    over = _plan(16, budget=8.0)
    over.options = PlanOptions(bits_per_value=4.0, schedule="uniform", rank_multiple=4)
    assert over_budget(over) and not over_budget(_plan(16, budget=8.0))
    listed = [Candidate("commute", 16), Candidate("commute", 8)]
    best, _ = best_candidate(lambda c: (over, 1.0) if c.latent_bits == 16 else (_plan(8), 2.0),
                             listed, progress=False)
    assert best.options.latent_bits == 8  # the lower loss was over the budget
    with pytest.raises(UnreachableFraction, match="over the budget"):
        best_candidate(lambda c: (over, 1.0), listed, progress=False)


def test_without_a_loss_the_first_candidate_that_plans_wins_unrecorded():
    calls = []

    def build(c):
        calls.append(c)
        if c.latent_bits == 16:
            raise UnreachableFraction("no room", 9.0)
        return _plan(c.latent_bits), None

    best, loss = best_candidate(build, candidates(["commute"], (16, 8, 4), (32,), False),
                                progress=False)
    assert best.options.latent_bits == 8 and best.candidates == [] and len(calls) == 2
    assert loss is None


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama"))


def test_a_bit_budget_measures_plain_quantization_and_keeps_the_least_loss(model, tmp_path,
                                                                           monkeypatch):
    """Through the real cache on held-out calibration windows (a tiny random model: which
    candidate wins is not the point): plain 8- and 4-bit quantization fit 9.5 bits per value
    (9 and 5 bits with groups of 32, 8.5 and 4.5 with 64) and are measured; the plan kept
    has the least loss, its recorded loss is its own, and no candidate is over the budget."""
    from lorc_fx.analysis import analyze
    from lorc_fx.search.split import held_out_loss

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.api.NEGLIGIBLE_LOSS", -math.inf)  # no early end: measure all
    blocks = analyze(model)
    report = compress(model, bits_per_value=9.5, basis="weight", schedule="uniform",
                      rope="commute", blocks=blocks, progress=False)
    measured = report.plan.candidates
    names = [c["candidate"] for c in measured]
    assert {f"plain KV quantization, {b}-bit, G{g}" for b in (8, 4) for g in (32, 64)} <= \
        set(names)
    assert len(measured) == 9  # 16-bit, 8- and 4-bit latents in groups of 32 and 64, 4 plain
    assert measured[0]["loss"] == min(c["loss"] for c in measured)
    assert all(c["bits_per_value"] <= 9.5 + 0.5 for c in measured)
    assert math.isclose(held_out_loss(model, blocks, report.plan), measured[0]["loss"],
                        rel_tol=1e-9)
    assert "candidates measured" in str(report)


def test_a_plain_candidate_within_noise_of_the_full_model_ends_the_search(model, tmp_path,
                                                                          monkeypatch):
    """Plain 8-bit quantization comes first; within ``NEGLIGIBLE_LOSS`` of the uncompressed
    model's held-out loss it is kept and nothing after it is measured (no calibration)."""
    from lorc_fx.analysis import analyze
    from lorc_fx.search.split import calibration_loss, held_out_windows

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.api.NEGLIGIBLE_LOSS", 1.0)  # a tiny random model's int8 error
    monkeypatch.setattr("lorc_fx.api.resolve", lambda *a: pytest.fail("calibrated a basis"))
    blocks = analyze(model)
    report = compress(model, 0.5, blocks=blocks, progress=False)
    (only,) = report.plan.candidates
    assert only["candidate"] == "plain KV quantization, 8-bit, G64"
    assert report.plan.kind == "plain" and report.plan.options.latent_bits == 8
    assert str(report).startswith(f"plain KV quantization of {len(blocks)} attention layers, "
                                  "no low rank: keys (after RoPE) and values stored as 8-bit")
    full = calibration_loss(model, blocks, None, held_out_windows(model, report.plan.options))
    assert only["loss"] <= full + 1.0


def test_a_bit_budget_measures_keys_water_filled_beside_plain_values(model, tmp_path,
                                                                      monkeypatch):
    """With reconstruct mode searched the water-filled keys are a measured candidate; where
    it wins, the plan kept is of its kind and its recorded loss is its own."""
    from lorc_fx.analysis import analyze
    from lorc_fx.search.split import held_out_loss

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.api.NEGLIGIBLE_LOSS", -math.inf)
    blocks = analyze(model)
    report = compress(model, bits_per_value=7.0, basis="weight", schedule="uniform",
                      rope="reconstruct", blocks=blocks, progress=False)
    measured = {c["candidate"]: c for c in report.plan.candidates}
    (name,) = [n for n, c in measured.items() if c["keys_waterfilled"]]
    assert measured[name]["bits_per_value"] <= 7.0 + 1e-9
    if report.plan.kind == "keys_waterfilled":
        assert math.isclose(held_out_loss(model, blocks, report.plan), measured[name]["loss"],
                            rel_tol=1e-9)
        assert "keys water-filled" in str(report)


def test_below_plain_quantization_vector_codes_are_measured(model, tmp_path, monkeypatch):
    """At 3 bits per value no plain candidate fits: the vector candidate is planned (books
    fitted on calibration latents of the model, cached on disk) and measured, within the
    budget, and its recorded loss is its own where it wins; at 9.5 bits it is not planned."""
    from lorc_fx.analysis import analyze
    from lorc_fx.plan.options import CalibrationOptions
    from lorc_fx.search.split import held_out_loss

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    blocks = analyze(model)
    calibration = CalibrationOptions(tokens=1024, window=128)
    report = compress(model, bits_per_value=3.0, basis="weight", schedule="uniform",
                      rope="reconstruct", blocks=blocks, progress=False,
                      calibration=calibration)
    measured = {c["candidate"]: c for c in report.plan.candidates}
    (name,) = [n for n, c in measured.items() if c["vector"]]
    assert not any(c["plain"] for c in measured.values())
    assert measured[name]["bits_per_value"] <= 3.0 + 1e-9
    assert list((tmp_path / "calibration").glob("vector-*.pt"))
    if report.plan.kind == "vector":
        assert math.isclose(held_out_loss(model, blocks, report.plan), measured[name]["loss"],
                            rel_tol=1e-9)
        assert "vector codes:" in str(report)
    above = compress(model, bits_per_value=9.5, basis="weight", schedule="uniform",
                     rope="reconstruct", blocks=blocks, progress=False, calibration=calibration)
    assert not any(c["vector"] for c in above.plan.candidates)
