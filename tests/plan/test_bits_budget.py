"""The plan's budget in bytes: ``bits_per_value`` and ``cache_fraction`` with quantized
latents (issue #13), on random layers (pure ``plan_layers``)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import plain_quantized_plan, plan_layers
from lorc_fx.plan.schedules import UnreachableFraction
from helpers.plan_inputs import random_layers


@pytest.mark.parametrize("bad", [0.1, 16.5, "4", float("nan"), True])
def test_bits_per_value_is_checked(bad):
    with pytest.raises(ValueError, match=r"bits_per_value must be a number in \[0.5, 16\]"):
        PlanOptions(bits_per_value=bad)


def _step_bits(plan) -> float:
    """What one rank step of latents costs in bits per value (floats at 16 bits)."""
    full, _ = plan.cache_elements_per_token()
    return plan.options.rank_multiple * plan.options.latent_bits_per_value(16) / full


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), group=st.sampled_from([8, 16, 32, 64]),
       budget=st.floats(1.0, 16.0), rope=st.sampled_from(["commute", "reconstruct"]),
       keep_first=st.integers(0, 1), schedule=st.sampled_from(["uniform", "greedy",
                                                                "calibrated"]),
       seed=st.integers(0, 3))
def test_a_plan_meets_its_bit_budget(bits, group, budget, rope, keep_first, schedule, seed):
    """Within one rank step of the budget, or every latent kept (quantized latents at full
    width may cost less than the budget); the angle log and full layers counted."""
    layers = random_layers(seed)
    options = PlanOptions(bits_per_value=budget, latent_bits=bits, latent_group=group,
                          rope=rope, keep_first=keep_first, schedule=schedule,
                          rank_multiple=4)
    try:
        plan = plan_layers(layers, options, dtype_bits=16)
    except UnreachableFraction as err:
        assert "bits_per_value" in str(err) and f"{bits}-bit latents" in str(err)
        full = sum(l.k_weight.shape[0] + l.v_weight.shape[0] for l in layers)
        assert err.lowest > budget - 4 * options.latent_bits_per_value(16) / full
        return
    step = _step_bits(plan)
    every_latent = all(l.k_rank == l.k_full and l.v_rank == l.v_full for l in plan.layers)
    assert plan.bits_per_value <= budget + step + 1e-9 or every_latent
    assert plan.bits_per_value >= budget - 2 * step - 1e-9 or every_latent
    # one count, three views: bits per value, fraction of a 16-bit cache, bytes per token
    full, _ = plan.cache_elements_per_token()
    assert plan.cache_fraction * 16 == pytest.approx(plan.bits_per_value, rel=1e-12)
    assert 8 * plan.cache_bytes_per_token(2)[1] / full == pytest.approx(plan.bits_per_value,
                                                                        rel=1e-12)


@pytest.mark.parametrize("bits, group", [(16, 32), (8, 32), (4, 16), (4, 64)])
@pytest.mark.parametrize("budget", [3.0, 6.0, 9.5])
def test_bits_per_value_is_a_fraction_of_a_16_bit_cache(bits, group, budget):
    """On a 16-bit model the two ways of saying the budget plan the same ranks."""
    layers = random_layers(1)
    common = dict(latent_bits=bits, latent_group=group, schedule="uniform", rank_multiple=4)
    try:
        by_bits = plan_layers(layers, PlanOptions(bits_per_value=budget, **common), dtype_bits=16)
    except UnreachableFraction:
        with pytest.raises(UnreachableFraction):
            plan_layers(layers, PlanOptions(cache_fraction=budget / 16, **common), dtype_bits=16)
        return
    by_fraction = plan_layers(layers, PlanOptions(cache_fraction=budget / 16, **common),
                              dtype_bits=16)
    assert [(l.k_rank, l.v_rank) for l in by_bits.layers] == \
        [(l.k_rank, l.v_rank) for l in by_fraction.layers]
    assert by_bits.bits_per_value == by_fraction.bits_per_value


def test_cache_fraction_counts_bytes_of_the_models_dtype():
    """A float32 model: fraction 0.25 (8 bits of 32) at 8-bit latents (groups of 32: 9 bits
    per value, scales and zero points at 16 bits) keeps 8/9 of the width, where 16-bit
    latents would keep 0.25."""
    layers = random_layers(2)
    plan = plan_layers(layers, PlanOptions(cache_fraction=0.25, latent_bits=8, latent_group=32,
                                           schedule="uniform", rank_multiple=1), dtype_bits=32)
    full, kept = plan.cache_elements_per_token()
    assert kept / full == pytest.approx(8 / 9, abs=1 / 16)
    assert plan.cache_fraction == pytest.approx(0.25, abs=1 / 64)
    assert plan.bits_per_value == pytest.approx(kept / full * 9, rel=1e-12)  # 8 + 2·16/32


def test_an_unreachable_bit_budget_is_said_in_bits():
    with pytest.raises(UnreachableFraction, match=r"bits_per_value 0.5 is out of reach .* "
                                                  r"16-bit latents: it reaches \["):
        plan_layers(random_layers(0), PlanOptions(bits_per_value=0.5, schedule="uniform"),
                    dtype_bits=16)


@pytest.mark.parametrize("bits, group, head_dim, expected", [
    (8, 64, 64, 8.5), (4, 64, 64, 4.5), (4, 32, 64, 5.0),
    # values per token within a head: a head of 8 channels is one group (4 bits of scale)
    (8, 64, 8, (8.5 + 12) / 2), (4, 4, 8, (4 + 8 + 4 + 8) / 2)])
def test_plain_quantized_plan_is_full_width_identity(bits, group, head_dim, expected):
    layers = random_layers(3, head_dim=head_dim)
    plan = plain_quantized_plan(layers, PlanOptions(latent_bits=bits, latent_group=group,
                                                    rope="reconstruct"), dtype_bits=16)
    assert plan.scheme.name == "plain" and plan.options.rope == "commute" and plan.rotary_log == 0
    for layer in plan.layers:
        assert torch.equal(layer.k_basis, torch.eye(layer.k_full, dtype=torch.float64))
        assert torch.equal(layer.v_rebuild, torch.eye(layer.v_full, dtype=torch.float64))
        assert layer.k_latent_of == "post_rope" and not layer.skipped
        assert (layer.k_code.group, layer.k_code.axis) == (group, -2)
        assert (layer.v_code.group, layer.v_code.axis) == (min(group, head_dim), -1)
    assert plan.bits_per_value == expected
    assert math.isclose(plan.cache_fraction, expected / 16)
    with pytest.raises(ValueError, match="latent_bits 8 or 4"):
        plain_quantized_plan(layers, PlanOptions(latent_bits=16))
