"""Cached vector codebooks are reused under the bases they were fitted under, and only then;
the vector scheme's allocation follows the weights it is given."""
import logging
from dataclasses import replace

import torch

from lorc_fx.plan.planner import PlanOptions, plan_layers
from lorc_fx.schemes.vector import vector_plan
from lorc_fx.search import codebooks as codebooks
from helpers.plan_inputs import random_layers


def _fake_passes(monkeypatch, tmp_path, measurable=True):
    """``codebooks`` writing to ``tmp_path``, its model passes faked on random latents: the
    forward and backward (sensitivities and latents; ``None`` where not ``measurable``) and
    the forward through the cache (latents). Returns the calls each got."""
    gen = torch.Generator().manual_seed(0)
    calls = {"both": [], "latents": [], "fits": []}
    monkeypatch.setattr(codebooks, "_books_file",
                        lambda model, plan, what="vector", key=None:
                        tmp_path / f"{what}-x.pt")

    def latents(sides):
        return {side: torch.randn(300, 16, generator=gen) for side in sides}

    def both(model, blocks, plan, sides, windows, keep_latents=True):
        calls["both"].append(keep_latents)
        if not measurable:
            return None
        return ({side: torch.rand(16, dtype=torch.float64, generator=gen) for side in sides},
                latents(sides) if keep_latents else {})

    monkeypatch.setattr(codebooks, "sensitivities_and_latents", both)
    monkeypatch.setattr(codebooks, "calibration_latents", lambda model, blocks, plan, windows:
                        calls["latents"].append(1) or latents(codebooks.coded_sides(plan)))
    fit = codebooks.fit_books
    monkeypatch.setattr(codebooks, "fit_books", lambda samples, tails: calls["fits"].append(1)
                        or fit(samples, widths=codebooks.WIDTHS, iters=2, tails=tails))
    return calls


def test_cached_books_are_reused_under_the_same_bases_only(tmp_path, monkeypatch, caplog):
    full = plan_layers(random_layers(0, n_layers=2), PlanOptions(1.0, "uniform", "reconstruct"))
    calls = _fake_passes(monkeypatch, tmp_path, measurable=False)

    books, rho, weights = codebooks.books_and_sensitivities(None, [], full, None)
    again, rho_again, _ = codebooks.books_and_sensitivities(None, [], full, None)
    assert weights is None and len(calls["fits"]) == len(calls["latents"]) == 1
    side = next(iter(books))
    for b in codebooks.WIDTHS:
        assert all(torch.equal(x, y) for x, y in zip(books[side][b].tables[0],
                                                     again[side][b].tables[0]))
        assert torch.equal(rho[side][b], rho_again[side][b])

    # what another thread count does to the bases (~1e-12): the books are still theirs
    nudged = [replace(l, k_basis=l.k_basis + 1e-10) for l in full.layers]
    codebooks.books_and_sensitivities(None, [], replace(full, layers=nudged), None)
    assert len(calls["fits"]) == 1
    # a basis that moved: the books coded other latents, so they are fitted again, said once
    moved = [replace(l, v_basis=l.v_basis.flip(0)) for l in full.layers]
    with caplog.at_level(logging.WARNING, logger="lorc_fx"):
        codebooks.books_and_sensitivities(None, [], replace(full, layers=moved), None)
    assert len(calls["fits"]) == 2
    assert any("not those the cached codebooks" in r.getMessage() for r in caplog.records)


def test_a_first_plan_runs_the_calibration_text_once(tmp_path, monkeypatch):
    """Where the sensitivities can be measured, their forward and backward also gives the
    latents the books are fitted on: no forward through the cache. Both are kept beside each
    other: a later plan under the same bases runs nothing and reads the same; one under
    moved bases measures and fits again; with the books on disk, the sensitivities' pass keeps
    no latents."""
    full = plan_layers(random_layers(0, n_layers=2), PlanOptions(1.0, "uniform", "reconstruct"))
    calls = _fake_passes(monkeypatch, tmp_path)
    books, rho, first = codebooks.books_and_sensitivities(None, [], full, None)
    assert calls == {"both": [True], "latents": [], "fits": [1]}
    _, rho_again, again = codebooks.books_and_sensitivities(None, [], full, None)
    assert calls == {"both": [True], "latents": [], "fits": [1]}
    assert first.keys() == again.keys() and all(torch.equal(first[s], again[s]) for s in first)
    side = next(iter(rho))
    assert all(torch.equal(rho[side][b], rho_again[side][b]) for b in codebooks.WIDTHS)

    moved = replace(full, layers=[replace(l, k_basis=l.k_basis.flip(0)) for l in full.layers])
    codebooks.books_and_sensitivities(None, [], moved, None)
    assert calls == {"both": [True, True], "latents": [], "fits": [1, 1]}
    (tmp_path / "sensitivity-x.pt").unlink()
    codebooks.books_and_sensitivities(None, [], moved, None)
    assert calls == {"both": [True, True, False], "latents": [], "fits": [1, 1]}


def _two_layers_with_books():
    """A full-rank plan of two random layers, its inputs, coded sides, and books of widths 1,
    2 and 4 with their errors, fitted on random latents."""
    inputs = random_layers(0, n_layers=2)
    full = plan_layers(inputs, PlanOptions(1.0, "uniform", "reconstruct"))
    gen = torch.Generator().manual_seed(0)
    sides = codebooks.coded_sides(full)
    samples = {side: torch.randn(400, 16, generator=gen) for side in sides}
    books, rho = codebooks.fit_books(samples, widths=(1, 2, 4), iters=2)
    return inputs, full, sides, books, rho


def _bits_per_token(plan) -> dict:
    """Each side's bits a token (0 where it stores nothing)."""
    return {(l.layer, s): getattr(l, f"{s}_code").spec.bits_per_token()
            if getattr(l, f"{s}_code") is not None else 0.0
            for l in plan.layers for s in ("k", "v")}


def test_the_allocation_spends_bits_where_the_weights_say_the_loss_minds():
    """The same books and errors, the weight of one layer's channels ×1000 then the other's:
    the heavier layer's latents get more bits each time, within the same budget."""
    inputs, full, sides, books, rho = _two_layers_with_books()
    options = PlanOptions.of(full.options, bits_per_value=3.0)

    def bits(heavy: int) -> dict:
        weights = {side: torch.ones(16, dtype=torch.float64) * (1000 if side[0] == heavy else 1)
                   for side in sides}
        plan = vector_plan(full, inputs, options, books, rho, 0.5, weights)
        assert plan.bits_per_value <= 3.0 + 1e-9
        return _bits_per_token(plan)

    first, second = bits(0), bits(1)
    for side in ("k", "v"):
        assert first[0, side] > first[1, side] and second[1, side] > second[0, side]


def test_layers_favoured_for_retrieval_get_more_bits_and_say_why():
    """The same books, errors and weights: the layer favoured for retrieval gets more bits a
    token on both sides than unfavoured, the other fewer, within the same budget, and its plan
    says why; ``retrieval_weight=1`` favours nothing."""
    inputs, full, sides, books, rho = _two_layers_with_books()
    weights = {side: torch.ones(16, dtype=torch.float64) for side in sides}

    def planned(weight: float, favoured: dict):
        options = PlanOptions.of(full.options, bits_per_value=3.0, retrieval_weight=weight)
        plan = vector_plan(full, inputs, options, books, rho, 0.5, weights, favoured)
        assert plan.bits_per_value <= 3.0 + 1e-9
        return plan, _bits_per_token(plan)

    _, before = planned(16.0, {})
    favoured, after = planned(16.0, {1: "retrieves"})
    for side in ("k", "v"):
        assert after[1, side] > before[1, side] and after[0, side] < before[0, side]
    assert favoured.layers[1].note == "weighed ×16 for retrieval (retrieves)"
    assert favoured.layers[0].note == ""
    assert planned(1.0, {1: "retrieves"})[1] == before


def test_retrieval_is_favoured_at_the_first_weight_within_its_cost(monkeypatch, caplog):
    """×16, else ×4, whichever first costs at most ``RETRIEVAL_COST`` of held-out loss; the
    plan unfavoured (its ``retrieval_weight`` 1), said, where both cost more."""
    from lorc_fx.schemes import vector

    monkeypatch.setattr(vector, "retrieval_favoured", lambda *args: {1: "retrieves"})
    plan = plan_layers(random_layers(0, n_layers=2), PlanOptions(1.0, "uniform", "reconstruct"))
    options = PlanOptions(bits_per_value=2.0)
    assert options.retrieval_weight == 16

    def favour(costs: dict[float, float]):
        tried = []

        def favouring(weight, favoured):
            tried.append(weight)
            return replace(plan, rotary_log=int(weight)), 2.5 + costs[weight]
        chosen, loss = vector.favour_retrieval(None, None, [], options, plan, 2.5, favouring)
        return chosen, loss, tried

    chosen, loss, tried = favour({16: 0.01})
    assert (chosen.rotary_log, loss, tried) == (16, 2.51, [16])
    chosen, loss, tried = favour({16: 0.035, 4: 0.011})
    assert (chosen.rotary_log, loss, tried) == (4, 2.511, [16, 4])
    with caplog.at_level(logging.WARNING, logger="lorc_fx"):
        chosen, loss, tried = favour({16: 0.05, 4: 0.03})
    assert (chosen.rotary_log, loss, tried) == (plan.rotary_log, 2.5, [16, 4])
    assert chosen.options.retrieval_weight == 1
    assert any("favour no layer for retrieval" in r.getMessage() for r in caplog.records)


def test_answers_weigh_at_the_largest_weight_within_the_retrieval_cost(caplog):
    """×4, else ×2, else ×1 the text's total, whichever first costs at most
    ``RETRIEVAL_COST`` of held-out loss over the text's weights alone before any layer was
    favoured (the two levers share one cap); that plan itself, said, where all cost more."""
    from lorc_fx.schemes import vector

    plan = plan_layers(random_layers(0, n_layers=2), PlanOptions(1.0, "uniform", "reconstruct"))
    options = PlanOptions(bits_per_value=2.0)
    assert options.answer_weight == 4

    def weigh(costs: dict[float, float], unfavoured: float = 2.5):
        tried = []

        def weighing(weight):
            tried.append(weight)
            return replace(plan, rotary_log=int(weight)), 2.5 + costs[weight]
        chosen, loss = vector.weigh_answers(options, plan, 2.51, unfavoured, weighing)
        return chosen.rotary_log, loss, tried

    assert weigh({4: 0.019}) == (4, 2.519, [4])
    assert weigh({4: 0.03, 2: -0.01}) == (2, 2.49, [4, 2])
    assert weigh({4: 0.05, 2: 0.021, 1: 0.004}) == (1, 2.504, [4, 2, 1])
    # the favoured layers' cost counts: ×1's 2.512 is 0.022 over the unfavoured 2.49
    assert weigh({4: 0.022, 2: 0.021, 1: 0.012}, unfavoured=2.49) == (
        plan.rotary_log, 2.51, [4, 2, 1])
    with caplog.at_level(logging.WARNING, logger="lorc_fx"):
        assert weigh({4: 0.05, 2: 0.04, 1: 0.03}) == (plan.rotary_log, 2.51, [4, 2, 1])
    assert any("weigh no channel by retrieval answers" in r.getMessage() for r in caplog.records)
