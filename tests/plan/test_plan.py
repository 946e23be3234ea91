"""Properties of the rank plan: the paper's bound, monotone progressive ranks, fractions."""
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from lorc_fx.analysis.records import RopeLayout
from lorc_fx.plan.planner import PlanOptions, _key_spectrum, _value_spectrum, plan_layers
from lorc_fx.plan.schedules import ScheduleInput, UnreachableFraction
from lorc_fx.plan.spectra import real_spectrum, rope_commuting_spectrum, weighted_spectrum
from helpers.plan_inputs import random_layers


from helpers.rope_ref import rotate


def least_rank(spectrum, multiple: int) -> int:
    return ScheduleInput([], [], [], [], [], 1.0, multiple).least_rank(spectrum)


def widest_step(spectrum, multiple: int) -> int:
    """The largest gap between neighbouring ranks a schedule may give this projection."""
    ladder = [r for r in spectrum.valid_ranks if r % multiple == 0 or r == spectrum.width]
    return max(b - a for a, b in zip(ladder, ladder[1:]))

SETTINGS = settings(max_examples=25, deadline=None)


ropes = st.sampled_from([RopeLayout(), RopeLayout("half", 8), RopeLayout("interleaved", 8),
                         RopeLayout("half", 4)])


@SETTINGS
@given(rows=st.integers(2, 24), cols=st.integers(2, 24), seed=st.integers(0, 10_000),
       data=st.data())
def test_theorem_1_truncation_error_bound(rows, cols, seed, data):
    """‖Wx − W̃x‖ ≤ σ_{k+1}‖x‖ for the rank-k truncation through the basis."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    k = data.draw(st.integers(0, rows))
    basis = real_spectrum(w).basis(k)
    w_tilde = basis.T @ basis @ w
    sigma = torch.linalg.svdvals(w)
    bound = float(sigma[k]) if k < len(sigma) else 0.0
    for x in torch.randn(8, cols, generator=gen, dtype=torch.float64):
        assert torch.linalg.norm(w @ x - w_tilde @ x) <= bound * torch.linalg.norm(x) + 1e-9


@SETTINGS
@given(seed=st.integers(0, 10_000), n_layers=st.integers(2, 8), kv_heads=st.integers(1, 3),
       rope=ropes, fraction=st.floats(0.55, 1.0), multiple=st.sampled_from([1, 2, 8]))
def test_progressive_ranks_never_increase_and_meet_fraction(seed, n_layers, kv_heads, rope,
                                                           fraction, multiple):
    layers = random_layers(seed, n_layers, kv_heads, 8, 40, rope)
    try:
        plan = plan_layers(layers, PlanOptions(fraction, "progressive", rank_multiple=multiple))
    except UnreachableFraction as err:  # below what the formula reaches with d_min = 0
        assert fraction < err.lowest
        return
    # ratios never increase with depth, except where a deeper layer sits at the least rank it
    # may keep (a RoPE-commuting spectrum's smallest valid rank can exceed a shallower share)
    leasts = [(least_rank(_key_spectrum(l, PlanOptions(rope="commute")), multiple),
               least_rank(_value_spectrum(l), multiple)) for l in layers]
    for (a, b), (lk, lv) in zip(zip(plan.layers, plan.layers[1:]), leasts[1:]):
        assert b.k_rank / b.k_full <= a.k_rank / a.k_full or b.k_rank == lk
        assert b.v_rank / b.v_full <= a.v_rank / a.v_full or b.v_rank == lv
    cum = [l.log_kappa_cum for l in plan.layers]
    assert cum == sorted(cum, reverse=True)  # κ ≥ 1, so cumulative products shrink with depth
    step = 2 * max(multiple, 2) / sum(l.k_full + l.v_full for l in plan.layers)
    assert abs(plan.cache_fraction - fraction) <= step + 1e-12


@SETTINGS
@given(rows=st.integers(2, 16), cols=st.integers(2, 16), seed=st.integers(0, 10_000),
       data=st.data())
def test_weighted_spectrum_is_the_best_reconstruction_under_its_metrics(rows, cols, seed, data):
    """The oblique basis rebuilds exactly at full rank, its error under ``diag(m)`` and ``G``
    is the dropped energy, and no orthonormal rank-r basis (here: the input-whitened SVD,
    the best one for ``m = 1``) does better under that metric."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    a = torch.randn(cols, cols, generator=gen, dtype=torch.float64)
    gram = a @ a.T + 0.1 * torch.eye(cols, dtype=torch.float64)
    m = torch.logspace(-2, 2, rows, dtype=torch.float64)[torch.randperm(rows, generator=gen)]
    spectrum = weighted_spectrum(w, gram, m)
    torch.testing.assert_close(spectrum.rebuild(rows) @ spectrum.basis(rows).T,
                               torch.eye(rows, dtype=torch.float64))
    r = data.draw(st.integers(0, rows))
    root = torch.linalg.cholesky(gram)
    error = lambda projector: float((m.sqrt()[:, None] * ((torch.eye(rows, dtype=torch.float64)
                                                            - projector) @ w @ root)).square().sum())
    ours = error(spectrum.rebuild(r).T @ spectrum.basis(r))
    assert ours == pytest.approx(spectrum.dropped_energy(r), rel=1e-6, abs=1e-9)
    plain = real_spectrum(w, gram).basis(r)
    assert ours <= error(plain.T @ plain) * (1 + 1e-9) + 1e-9


@SETTINGS
@given(seed=st.integers(0, 10_000), fraction=st.floats(0.125, 1.0), rope=ropes)
@example(seed=8192, fraction=0.703125, rope=RopeLayout("half", 4))  # keys jump from rank 2 to 14
def test_uniform_meets_fraction(seed, fraction, rope):  # 0.125: one rank step of 2 per side
    """Within one step of the coarsest rank ladder: a RoPE-commuting key spectrum may offer
    only ranks far apart (a complex direction shared by heads is kept whole)."""
    layers = random_layers(seed, 4, 2, 8, 32, rope)
    try:
        plan = plan_layers(layers, PlanOptions(fraction, "uniform", rank_multiple=2))
    except UnreachableFraction as err:  # the least valid key rank may exceed one step
        assert fraction < err.lowest
        return
    spectra = [s for l in layers for s in (_key_spectrum(l, PlanOptions(rope="commute")), _value_spectrum(l))]
    step = max(widest_step(s, 2) for s in spectra)
    assert abs(plan.cache_fraction - fraction) <= step / (4 * 2 * 2 * 8) + 1e-12


@pytest.mark.parametrize("rope_mode", ["commute", "reconstruct"])
@pytest.mark.parametrize("schedule", ["progressive", "uniform"])
def test_full_fraction_gives_identity_projections(rope_mode, schedule):
    layers = random_layers(1, 3, 2, 8, 32, RopeLayout("half", 8))
    plan = plan_layers(layers, PlanOptions(1.0, schedule, rope_mode))
    full, kept = plan.cache_elements_per_token()  # every dim, and in reconstruct mode the angles
    assert plan.rotary_log == (8 // 2 + 1 if rope_mode == "reconstruct" else 0)  # angles, magnitude
    assert kept == full + plan.rotary_log
    for l in plan.layers:
        for basis, full in ((l.k_basis, l.k_full), (l.v_basis, l.v_full)):
            torch.testing.assert_close(basis.T @ basis, torch.eye(full, dtype=torch.float64))


@SETTINGS
@given(seed=st.integers(0, 10_000), kv_heads=st.integers(1, 4),
       head_dim=st.sampled_from([4, 8, 12]), data=st.data())
def test_rope_commuting_basis_commutes_with_rope(seed, kv_heads, head_dim, data):
    style = data.draw(st.sampled_from(["half", "interleaved"]))
    rotary = data.draw(st.sampled_from([d for d in range(2, head_dim + 1, 2)]))
    rope = RopeLayout(style, rotary)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(kv_heads * head_dim, 24, generator=gen, dtype=torch.float64)
    spectrum = rope_commuting_spectrum(w, kv_heads, head_dim, rope)
    rank = data.draw(st.sampled_from(spectrum.valid_ranks))
    basis = spectrum.basis(rank)
    projector = basis.T @ basis
    keys = torch.randn(5, kv_heads * head_dim, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0.0, 1.0, 7.0, 123.0, 4096.0])[:, None]
    rotate_flat = lambda k: rotate(k.view(5, kv_heads, head_dim), pos, rope).reshape(5, -1)
    torch.testing.assert_close(rotate_flat(keys) @ projector.T, rotate_flat(keys @ projector.T))
    torch.testing.assert_close(basis @ basis.T, torch.eye(rank, dtype=torch.float64))


def test_complex_basis_is_optimal_among_invariant_subspaces_at_full_rank():
    w = torch.randn(2 * 8, 16, dtype=torch.float64)
    spectrum = rope_commuting_spectrum(w, 2, 8, RopeLayout("half", 8))
    assert math.isclose(float(spectrum.energy.sum()), float(w.square().sum()), rel_tol=1e-9)


def test_plan_is_deterministic():
    layers = random_layers(3, 4, 2, 8, 32, RopeLayout("half", 8))
    a = plan_layers(layers, PlanOptions(0.7))
    b = plan_layers(layers, PlanOptions(0.7))
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.k_basis, y.k_basis) and torch.equal(x.v_basis, y.v_basis)


def test_threshold_and_keep_first_skip_layers():
    layers = random_layers(4, 6, 2, 8, 32, RopeLayout("half", 8))
    probe = plan_layers(layers, PlanOptions(1.0))
    threshold = math.exp(probe.layers[2].log_kappa_cum) * 1.0001  # layers 0..1 exceed it
    plan = plan_layers(layers, PlanOptions(0.8, skip_threshold=threshold))
    assert [l.skipped for l in plan.layers] == [True, True, False, False, False, False]
    assert all(l.k_rank == l.k_full for l in plan.layers[:2])
    plan = plan_layers(layers, PlanOptions(0.8, keep_first=3))
    assert [l.skipped for l in plan.layers][:4] == [True, True, True, False]


def test_unreachable_fraction_reports_range():
    layers = random_layers(5, 6, 2, 8, 32, RopeLayout("half", 8))
    with pytest.raises(UnreachableFraction, match=r"reaches \[0\.\d+, 1\.000\]"):
        plan_layers(layers, PlanOptions(0.1, "progressive"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache_fraction=0.0), "cache_fraction"),
    (dict(cache_fraction=1.5), "cache_fraction"),
    (dict(cache_fraction=-0.2), "cache_fraction"),
    (dict(schedule="pyramid"), "unknown schedule"),
    (dict(rope="ignore"), "unknown rope mode"),
    (dict(basis="magic"), "unknown basis"),
    (dict(skip_threshold=-1.0), "skip_threshold"),
    (dict(keep_first=-1), "keep_first"),
])
def test_invalid_options_raise_clear_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions(**kwargs)


def test_non_float_or_meta_weights_are_refused_by_name():
    from lorc_fx.analysis.records import AttentionBlock, Projection
    from lorc_fx.plan.planner import layer_inputs

    block = AttentionBlock(0, None, Projection("k.weight", 0, 8), Projection("v.weight", 0, 8),
                           None, 2, 1, 8, k_path="none")
    with pytest.raises(ValueError, match=r"'k.weight' has dtype torch.int8"):
        layer_inputs({"k.weight": torch.zeros(8, 16, dtype=torch.int8),
                      "v.weight": torch.zeros(8, 16)}, [block])
    with pytest.raises(ValueError, match=r"'v.weight' is on the meta device"):
        layer_inputs({"k.weight": torch.zeros(8, 16),
                      "v.weight": torch.zeros(8, 16, device="meta")}, [block])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), schedule=st.sampled_from(["progressive", "uniform", "greedy",
                                                              "calibrated"]),
       fraction=st.floats(0.01, 1.0), multiple=st.sampled_from([1, 4, 8]))
def test_no_plan_zeroes_a_side_unless_asked(seed, schedule, fraction, multiple):
    """Every plan keeps at least one rank step of every compressed side, or refuses the
    fraction, saying the least it reaches; ``allow_zero_rank`` lets sides drop to 0."""
    layers = random_layers(seed)
    options = PlanOptions(fraction, schedule, basis="weight", rank_multiple=multiple,
                          key_fraction=0.5 if schedule == "calibrated" else None)
    try:
        plan = plan_layers(layers, options)
    except UnreachableFraction as err:
        assert fraction < err.lowest and f"{err.lowest:.3f}" in str(err)
        return
    assert all(l.k_rank > 0 and l.v_rank > 0 for l in plan.layers)


def test_zero_ranks_only_when_allowed():
    layers = random_layers(0)
    with pytest.raises(UnreachableFraction):
        plan_layers(layers, PlanOptions(0.05, "uniform", basis="weight", rank_multiple=1))
    plan = plan_layers(layers, PlanOptions(0.05, "uniform", basis="weight", rank_multiple=1,
                                           allow_zero_rank=True))
    assert any(l.k_rank == 0 or l.v_rank == 0 for l in plan.layers)


@pytest.mark.parametrize("option, value", [
    ("cache_fraction", True), ("cache_fraction", 0.0), ("cache_fraction", float("nan")),
    ("cache_fraction", "0.5"), ("rank_multiple", 2.5), ("rank_multiple", 0),
    ("rank_multiple", True), ("keep_first", -1), ("keep_first", 1.5), ("key_fraction", 2.0),
    ("skip_threshold", -1.0), ("allow_zero_rank", "yes")])
def test_bad_options_name_the_option_and_the_range(option, value):
    with pytest.raises(ValueError, match=option):
        PlanOptions(**{option: value})


def test_rank_multiple_wider_than_every_projection_is_refused():
    with pytest.raises(ValueError, match=r"rank_multiple=1000 .* choose 1\.\.\d+"):
        plan_layers(random_layers(0), PlanOptions(0.5, "uniform", basis="weight",
                                                  rank_multiple=1000))


def test_no_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="no attention layer to plan"):
        plan_layers([], PlanOptions(0.5, basis="weight"))


def test_option_names_match_the_registries():
    """options.py lists the names so it stays a leaf; the registries must agree with it."""
    from lorc_fx.plan.bases import BASES
    from lorc_fx.plan.options import BASIS_NAMES, SCHEDULE_NAMES
    from lorc_fx.plan.schedules import SCHEDULES

    assert set(SCHEDULES) == set(SCHEDULE_NAMES)
    assert set(BASES) == set(BASIS_NAMES)
