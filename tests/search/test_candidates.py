"""The plan search: every scheme's candidates scored by held-out loss at one budget."""
import math
import re

import pytest

from lorc_fx.api import compress
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import plan_layers
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.search.candidates import best_candidate, candidates, over_budget
from lorc_fx.report import plan_table
from lorc_fx.search.context import Candidate, SearchContext, Skipped
from helpers.families import build, config_for
from helpers.plan_inputs import random_layers


def listed(modes, widths, groups) -> list[Candidate]:
    """The candidates of every registered scheme (listing them builds nothing)."""
    return candidates(SearchContext(None, [], PlanOptions(), modes, widths, groups, True))


def test_the_candidates_hold_plain_quantization_at_each_width_and_group():
    every = listed(["commute", "reconstruct"], (16, 8, 4), (32, 64))
    of = lambda scheme, among=every: [c for c in among if c.scheme == scheme]
    assert {(c.latent_bits, c.latent_group) for c in of("plain")} == \
        {(8, 32), (8, 64), (4, 32), (4, 64)}
    assert {(c.rope, c.latent_bits, c.latent_group) for c in of("low_rank")} == \
        {(m, 16, 32) for m in ("commute", "reconstruct")} | \
        {(m, b, g) for m in ("commute", "reconstruct") for b in (8, 4) for g in (32, 64)}
    # the first group of a width comes first: its measured split is reused by the others
    assert [c.latent_group for c in of("low_rank") if c.latent_bits == 8] == [32, 64] * 2
    assert not of("plain", listed(["commute"], (16,), (32,)))
    # keys water-filled beside 4-bit values: right after the plain ones, where reconstruct
    # mode and 4 bits are searched
    (waterfilled,) = of("keys_waterfilled")
    assert every.index(waterfilled) == 4 and waterfilled.rope == "reconstruct"
    assert (waterfilled.latent_bits, waterfilled.latent_group) == (4, 64)
    assert not of("keys_waterfilled", listed(["commute"], (16, 8, 4), (32, 64)))
    # vector codes after them (planned only where no plain candidate fits): one, keys cached
    # before RoPE where that mode is searched, else after it (objective="speed")
    (vector,) = of("vector")
    assert every.index(vector) == 5 and vector.rope == "reconstruct"
    (vector,) = of("vector", listed(["commute"], (16, 8, 4), (32, 64)))
    assert vector.rope == "commute"
    assert not of("vector", listed(["reconstruct"], (4,), (32,)))
    assert not of("keys_waterfilled", listed(["reconstruct"], (16, 8), (64,)))


def _plan(bits: int, budget: float = 8.0):
    return plan_layers(random_layers(0), PlanOptions(bits_per_value=budget, latent_bits=bits,
                                                     schedule="uniform", rank_multiple=4),
                       dtype_bits=16)


def candidate(bits: int, build, scheme: str = "low_rank") -> Candidate:
    return Candidate(f"{scheme} at {bits} bits", scheme, build, "commute", bits)


def test_the_least_loss_wins_and_every_measured_candidate_is_recorded():
    losses = {16: 3.0, 8: 2.5, 4: 2.75}

    def refused():
        raise UnreachableFraction("no room", 9.0)

    every = [candidate(b, lambda b=b: (_plan(b), losses[b])) for b in (16, 8, 4)] + \
        [candidate(4, refused, "plain")]
    best, loss = best_candidate(every, progress=False)
    assert best.options.latent_bits == 8 and loss == 2.5
    assert [c["latent_bits"] for c in best.candidates] == [8, 4, 16]
    assert [c["loss"] for c in best.candidates] == [2.5, 2.75, 3.0]
    assert all(c["scheme"] == "low_rank" for c in best.candidates)


def test_each_schemes_least_loss_is_kept_and_a_skipped_candidate_is_reported_with_why():
    def skipped():
        raise Skipped("covered")

    losses = {}
    best, _ = best_candidate([candidate(8, lambda: (_plan(8), 2.5), "vector"),
                              candidate(4, lambda: (_plan(4), 2.25), "vector"),
                              candidate(4, skipped)], progress=False, scheme_losses=losses)
    assert losses == {"vector": 2.25}
    assert [c.get("loss") for c in best.candidates] == [2.25, 2.5, None]
    assert best.candidates[-1]["skipped"] == "covered"
    assert "  not measured (covered): low_rank at 4 bits" in plan_table(best).splitlines()


def test_no_low_rank_candidate_is_measured_where_vector_codes_planned():
    search = SearchContext(None, [], PlanOptions(), ["commute", "reconstruct"], (16, 8, 4),
                           (32, 64), True)
    low_rank = [c for c in candidates(search) if c.scheme == "low_rank"]
    assert all(c.skipped() is None for c in low_rank)
    search.scheme_losses["vector"] = 2.4
    assert all(c.skipped().startswith("vector codes planned at this budget (held-out loss "
                                      "2.4000)") for c in low_rank)
    assert not search.at_budget(0.3, True).scheme_losses  # another budget measures again


def test_the_full_models_loss_is_asked_only_before_another_candidate_is_built():
    asked, built = [], []

    def enough():
        asked.append(1)
        return 2.6

    def measured(bits, loss):
        def build():
            built.append(bits)
            return _plan(bits), loss
        return build

    covered = [Candidate(f"low rank at {b} bits", "low_rank", measured(b, 2.0), "commute", b,
                         skipped=lambda: "covered") for b in (8, 4)]
    best, loss = best_candidate([candidate(8, measured(8, 2.5), "vector"), *covered],
                                progress=False, enough=enough)
    assert (loss, built, asked) == (2.5, [8], [])  # nothing else was built: never asked
    best, loss = best_candidate([candidate(8, measured(8, 2.5), "vector"),
                                 candidate(4, measured(4, 2.0))], progress=False, enough=enough)
    assert (loss, built, asked) == (2.5, [8, 8], [1])  # within it: the search ends unbuilt
    best, loss = best_candidate([candidate(8, measured(8, 2.7), "vector"),
                                 candidate(4, measured(4, 2.0))], progress=False, enough=enough)
    assert (loss, built, len(asked)) == (2.0, [8, 8, 8, 4], 2)


def test_over_budget_candidates_are_left_out_and_no_plan_is_a_refusal():
    over = _plan(16, budget=8.0)
    over.options = PlanOptions(bits_per_value=4.0, schedule="uniform", rank_multiple=4)
    assert over_budget(over) and not over_budget(_plan(16, budget=8.0))
    best, _ = best_candidate([candidate(16, lambda: (over, 1.0)),
                              candidate(8, lambda: (_plan(8), 2.0))], progress=False)
    assert best.options.latent_bits == 8  # the lower loss was over the budget
    with pytest.raises(UnreachableFraction, match="over the budget"):
        best_candidate([candidate(16, lambda: (over, 1.0)), candidate(8, lambda: (over, 1.0))],
                       progress=False)


def test_a_budget_no_candidate_reaches_is_refused_with_the_least_any_reaches():
    over = _plan(16, budget=8.0)
    over.options = PlanOptions(bits_per_value=4.0, schedule="uniform", rank_multiple=4)

    def refused(lowest):
        def build():
            raise UnreachableFraction(f"reaches {lowest}", lowest)
        return build

    listed = [candidate(16, lambda: (over, 1.0)), candidate(8, refused(6.5)),
              candidate(4, refused(math.inf))]
    with pytest.raises(UnreachableFraction, match=re.escape(
            "bits_per_value 4 is out of reach on this model: the candidates reach [6.500, 16] "
            "(bits per value); ask for bits_per_value in that range (the least: reaches 6.5)")) as err:
        best_candidate(listed, progress=False, budget=over.options.budget)
    assert err.value.lowest == 6.5


def test_without_a_loss_the_first_candidate_that_plans_wins_unrecorded():
    calls = []

    def build(bits):
        calls.append(bits)
        if bits == 16:
            raise UnreachableFraction("no room", 9.0)
        return _plan(bits), None

    best, loss = best_candidate([candidate(b, lambda b=b: build(b)) for b in (16, 8, 4)],
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
    # no early end: measure all
    monkeypatch.setattr("lorc_fx.search.planning.NEGLIGIBLE_LOSS", -math.inf)
    blocks = analyze(model)
    report = compress(model, bits_per_value=9.5, basis="weight", schedule="uniform",
                      rope="commute", blocks=blocks, progress=False)
    measured = [c for c in report.plan.candidates if "skipped" not in c]
    names = [c["candidate"] for c in measured]
    assert {f"plain KV quantization, {b}-bit, G{g}" for b in (8, 4) for g in (32, 64)} <= \
        set(names)
    least = {b: min(c["loss"] for c in measured if c["scheme"] == "low_rank"
                    and c["latent_bits"] == b) for b in (4, 8)}
    # 8- and 4-bit latents in groups of 32 and 64, 4 plain, and 16-bit latents unless 8-bit
    # ones lost more than 4-bit ones (a wider width still is not measured)
    assert len(measured) == 8 + (least[8] <= least[4])
    assert len(report.plan.candidates) == 9  # the 16-bit one reported where it is skipped
    assert any(c["latent_bits"] == 16 for c in measured) == (least[8] <= least[4])
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
    # a tiny random model's int8 error
    monkeypatch.setattr("lorc_fx.search.planning.NEGLIGIBLE_LOSS", 1.0)
    monkeypatch.setattr("lorc_fx.search.context.resolve",
                        lambda *a: pytest.fail("calibrated a basis"))
    blocks = analyze(model)
    report = compress(model, 0.5, blocks=blocks, progress=False)
    (only,) = report.plan.candidates
    assert only["candidate"] == "plain KV quantization, 8-bit, G64"
    assert report.plan.scheme.name == "plain" and report.plan.options.latent_bits == 8
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
    monkeypatch.setattr("lorc_fx.search.planning.NEGLIGIBLE_LOSS", -math.inf)
    blocks = analyze(model)
    report = compress(model, bits_per_value=7.0, basis="weight", schedule="uniform",
                      rope="reconstruct", blocks=blocks, progress=False)
    measured = {c["candidate"]: c for c in report.plan.candidates}
    (name,) = [n for n, c in measured.items() if c["scheme"] == "keys_waterfilled"]
    assert measured[name]["bits_per_value"] <= 7.0 + 1e-9
    if report.plan.scheme.name == "keys_waterfilled":
        assert math.isclose(held_out_loss(model, blocks, report.plan), measured[name]["loss"],
                            rel_tol=1e-9)
        assert "keys water-filled" in str(report)


def test_below_plain_quantization_vector_codes_are_measured(model, tmp_path, monkeypatch):
    """At 3 bits per value no plain candidate fits: the vector candidate is planned (books
    fitted on calibration latents of the model, cached on disk) and measured, within the
    budget, and its recorded loss is its own where it wins; no low-rank candidate is
    measured after it (each reported skipped); at 9.5 bits it is not planned."""
    from lorc_fx.analysis import analyze
    from lorc_fx.plan.options import CalibrationOptions
    from lorc_fx.search.split import held_out_loss

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    # no early end (random weights: every candidate is within noise of the full model)
    monkeypatch.setattr("lorc_fx.search.planning.NEGLIGIBLE_LOSS", -math.inf)
    blocks = analyze(model)
    calibration = CalibrationOptions(tokens=1024, window=128)
    report = compress(model, bits_per_value=3.0, basis="weight", schedule="uniform",
                      rope="reconstruct", blocks=blocks, progress=False,
                      calibration=calibration)
    measured = {c["candidate"]: c for c in report.plan.candidates}
    (name,) = [n for n, c in measured.items() if c["scheme"] == "vector"]
    assert not any(c["scheme"] == "plain" for c in measured.values())
    assert measured[name]["bits_per_value"] <= 3.0 + 1e-9
    low_rank = [c for c in measured.values() if c["scheme"] == "low_rank"]
    assert low_rank and all("vector codes planned" in c["skipped"] for c in low_rank)
    assert list((tmp_path / "calibration").glob("vector-*.pt"))
    if report.plan.scheme.name == "vector":
        assert math.isclose(held_out_loss(model, blocks, report.plan), measured[name]["loss"],
                            rel_tol=1e-9)
        assert "vector codes:" in str(report)
    above = compress(model, bits_per_value=9.5, basis="weight", schedule="uniform",
                     rope="reconstruct", blocks=blocks, progress=False, calibration=calibration)
    assert not any(c["scheme"] == "vector" for c in above.plan.candidates)


def test_a_first_vector_plan_runs_the_calibration_text_once_for_bases_and_sensitivities(
        model, tmp_path, monkeypatch):
    """With a calibrated basis and nothing on disk, the vector candidate's first plan
    measures the bases' statistics and the loss's sensitivities in one pass (no pass of the
    sensitivities' own) and keeps both on disk."""
    from lorc_fx.analysis import analyze
    from lorc_fx.plan.options import CalibrationOptions

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.search.codebooks.sensitivities_and_latents",
                        lambda *a, **k: pytest.fail("a pass of the sensitivities' own"))
    report = compress(model, bits_per_value=3.0, basis="attention", schedule="uniform",
                      rope="reconstruct", blocks=analyze(model), progress=False,
                      calibration=CalibrationOptions(tokens=512, window=64))
    assert any(c["scheme"] == "vector" and "loss" in c for c in report.plan.candidates)
    kept = {f.name.split("-")[0] for f in (tmp_path / "calibration").glob("*.pt")}
    assert {"sensitivity", "vector"} <= kept


def test_vector_codes_are_refused_where_no_layer_caches_value_latents(model, tmp_path,
                                                                      monkeypatch):
    """Their books are fitted on the cached latents: with none (every layer kept as
    transformers builds it, as in a hybrid model numbered wrongly) there were no samples and
    the fit failed with a bare ``StopIteration``. Now the candidate is refused before any
    calibration."""
    from lorc_fx.analysis import analyze
    from lorc_fx.plan.scheme import SCHEMES
    from lorc_fx.search.planning import search_context

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.search.context.resolve",
                        lambda *a: pytest.fail("calibrated a basis"))
    search = search_context(model, analyze(model), PlanOptions(bits_per_value=3))
    for layer in search.layer_inputs():
        layer.compress_k = layer.compress_v = False
    (vector,) = SCHEMES["vector"].candidates(search)
    with pytest.raises(UnreachableFraction, match="no layer caches value latents"):
        vector.build()


def test_a_width_past_a_rising_loss_is_not_measured(model, tmp_path, monkeypatch):
    """Low-rank widths are measured narrowest first per RoPE mode; where the loss rose from
    4- to 8-bit latents the 16-bit candidate is skipped (said at INFO), where it fell it is
    measured (losses made up: the rule, not the model, is tested)."""
    from lorc_fx.schemes import low_rank

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.search.planning.NEGLIGIBLE_LOSS", -math.inf)
    for made_up, sixteen in (({4: 1.0, 8: 2.0, 16: 0.5}, False),
                             ({4: 2.0, 8: 1.0, 16: 0.5}, True)):
        order = []

        def planned(model, blocks, options, inputs, note, measure, made_up=made_up):
            order.append(options.latent_bits)
            return plan_layers(inputs, options), made_up[options.latent_bits]

        monkeypatch.setattr(low_rank, "planned", planned)
        report = compress(model, bits_per_value=9.5, basis="weight", schedule="uniform",
                          rope="commute", progress=False)
        assert order == sorted(order)  # narrowest first
        assert (16 in order) is sixteen
        assert (report.plan.candidates[0]["latent_bits"] == 16) is sixteen


def test_keys_water_filled_are_not_measured_where_the_rows_would_average_under_3_bits(
        model, tmp_path, monkeypatch):
    """The values (4 bits and a scale per head of 8 channels: 8 bits here) leave the keys
    2·B − 8 bits a value less the RoPE angle log: at 5 bits per value under 2, less than the
    narrowest row's 3.125, so the candidate is skipped, saying why, before the bases are
    calibrated or its rounding errors measured; at 7 bits it plans."""
    from lorc_fx.analysis import analyze
    from lorc_fx.plan.scheme import SCHEMES
    from lorc_fx.search.planning import search_context

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("lorc_fx.schemes.keys_waterfilled.rounding_errors",
                        lambda *a, **k: pytest.fail("rounding errors measured"))
    monkeypatch.setattr("lorc_fx.search.context.SearchContext.prepared",
                        lambda *a, **k: pytest.fail("the bases calibrated"))
    blocks = analyze(model)
    search = search_context(model, blocks, PlanOptions(
        bits_per_value=5.0, basis="weight", schedule="uniform", rope="reconstruct"))
    (waterfilled,) = SCHEMES["keys_waterfilled"].candidates(search)
    with pytest.raises(Skipped, match=r"each key row 1\.\d\d bits a token on average, less than "
                                      r"the narrowest row stores \(3\.125\)"):
        waterfilled.build()
    monkeypatch.undo()
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    search = search_context(model, blocks, PlanOptions(
        bits_per_value=7.0, basis="weight", schedule="uniform", rope="reconstruct"))
    (waterfilled,) = SCHEMES["keys_waterfilled"].candidates(search)
    plan, _ = waterfilled.build()
    assert plan.scheme.name == "keys_waterfilled" and plan.bits_per_value <= 7.0 + 1e-9
