"""Per-shard plans (``shards`` > 1): bases block-diagonal over equal groups of KV heads, the
same rank in every group, and ``Plan.local`` giving each group's own plan."""
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.analysis.records import RopeLayout
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import plain_quantized_plan, plan_layers
from lorc_fx.plan.spectra import block_diagonal, real_spectrum

from helpers.plan_inputs import random_layers

ROPES = [RopeLayout(), RopeLayout("half", 8), RopeLayout("interleaved", 4)]


def _sharded(seed, shards, kv_heads, rope):
    return [replace(l, shards=shards) for l in random_layers(seed, 3, kv_heads, 8, rope=rope)]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1000), shards=st.sampled_from([2, 4]),
       rope=st.sampled_from(ROPES), fraction=st.sampled_from([1.0, 0.75, 0.5]),
       schedule=st.sampled_from(["calibrated", "greedy", "uniform"]))
def test_bases_are_block_diagonal_with_one_rank_per_shard(seed, shards, rope, fraction, schedule):
    kv_heads = 4
    plan = plan_layers(_sharded(seed, shards, kv_heads, rope),
                       PlanOptions(cache_fraction=fraction, schedule=schedule, basis="weight",
                                   rank_multiple=2, shards=shards))
    width = kv_heads * 8 // shards
    for layer in plan.layers:
        for basis, rank in ((layer.k_basis, layer.k_rank), (layer.v_basis, layer.v_rank)):
            assert rank % shards == 0
            for s in range(shards):
                rows = basis[s::shards]
                outside = torch.cat([rows[:, :s * width], rows[:, (s + 1) * width:]], dim=1)
                assert outside.abs().max() == 0  # shard s's latent reads only its heads
                own = rows[:, s * width:(s + 1) * width]
                torch.testing.assert_close(own @ own.T, torch.eye(rank // shards, dtype=own.dtype))
    for s in range(shards):
        local = plan.local(s)
        assert local.shard == s and local.cache_fraction == pytest.approx(plan.cache_fraction)
        for whole, part in zip(plan.layers, local.layers):
            assert part.num_kv_heads == kv_heads // shards
            assert part.k_basis.shape == (whole.k_rank // shards, whole.k_full // shards)
            assert torch.equal(part.v_basis, whole.v_basis[s::shards, s * width:(s + 1) * width])


def test_one_shard_is_the_unsharded_plan():
    layers = random_layers(3, 3, 4, 8)
    options = PlanOptions(cache_fraction=0.5, basis="weight")
    one, two = plan_layers(layers, options), plan_layers(
        [replace(l, shards=2) for l in layers], replace(options, shards=2))
    assert one.local(0) is one
    assert [l.k_basis.shape for l in one.layers] == [l.k_basis.shape for l in two.layers]
    # the per-shard basis keeps less of the whole spectrum than the unconstrained one
    assert sum(l.k_energy_kept for l in two.layers) <= sum(l.k_energy_kept for l in one.layers) + 1e-9


@pytest.mark.parametrize("shards", [2, 4])
def test_a_plain_plans_shard_is_the_identity_on_its_own_dims(shards):
    """Plain KV quantization has no basis: each shard's plan keeps its heads' keys and values
    as they are, in their own order, so its codes group exactly as the whole model's do."""
    plan = plain_quantized_plan(_sharded(5, shards, 4, ROPES[1]),
                                PlanOptions(cache_fraction=0.5, latent_bits=8, shards=shards))
    for s in range(shards):
        local = plan.local(s)
        assert local.bits_per_value == pytest.approx(plan.bits_per_value)
        for part in local.layers:
            width = part.k_full
            assert width == 4 * 8 // shards and part.k_rank == width
            for matrix in (part.k_basis, part.v_basis, part.k_rebuild, part.v_rebuild):
                assert torch.equal(matrix, torch.eye(width, dtype=matrix.dtype))


def test_block_diagonal_spectrum_cuts_and_energy():
    gen = torch.Generator().manual_seed(0)
    parts = [real_spectrum(torch.randn(6, 10, generator=gen, dtype=torch.float64))
             for _ in range(3)]
    merged = block_diagonal(parts)
    assert merged.width == 18
    assert merged.valid_ranks == [0, 3, 6, 9, 12, 15, 18]
    assert merged.dropped_energy(6) == pytest.approx(sum(p.dropped_energy(2) for p in parts))


@pytest.mark.parametrize("kwargs, message", [
    (dict(shards=0), "shards must be an integer >= 1"),
    (dict(shards=2, basis="attention"), "basis='attention' has no per-shard form"),
])
def test_bad_shard_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions(**kwargs)
