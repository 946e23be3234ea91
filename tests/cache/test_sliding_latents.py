"""Low-rank latents in sliding-window layers: the window's ring (static) or list (dynamic)
holds latents, and both return what the other does; on a tiny Gemma 2 with sliding and full
layers alternating, low rank reaches a budget it could not when sliding layers stayed full,
and at full rank every generate path matches the uncompressed model."""
import contextlib

import pytest
import torch

import lorc_fx
from helpers.families import build, config_for
from helpers.pass_helpers import assert_same_generation, compiled, generate, prompt
from lorc_fx.cache import (LatentCache, LatentCodec, LatentSlidingLayer,
                          LatentStaticSlidingLayer)
from lorc_fx.cache.layers import PREFILL_TOKENS
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.schedules import UnreachableFraction

WINDOW, HEADS, DIM, RANK = 6, 2, 8, 10
# a prompt within the window, steps into and past it, continuations past it of at most
# PREFILL_TOKENS (returned as stored) and one prefill longer (its own tokens as computed)
STEPS = (3, 1, 1, 1, 1, 1, 9, 1, 2, 1, PREFILL_TOKENS + 8, 1, 1)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))


def _basis(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(HEADS * DIM, RANK, generator=g))
    return q.T.contiguous()  # (RANK, HEADS·DIM), orthonormal rows


def test_a_static_ring_of_latents_returns_what_the_dynamic_window_does():
    codec = LatentCodec(_basis(0), _basis(1), HEADS)
    dynamic = LatentSlidingLayer(WINDOW, codec)
    static = LatentStaticSlidingLayer(sum(STEPS), WINDOW, codec)
    g = torch.Generator().manual_seed(2)
    for tokens in STEPS:
        k, v = (torch.randn(2, HEADS, tokens, DIM, generator=g) for _ in range(2))
        want_k, want_v = dynamic.update(k, v)
        got_k, got_v = static.update(k, v)
        n = want_k.shape[-2]  # while the window fills, the static layer returns all its slots
        assert got_k.shape[-2] == (WINDOW if n < WINDOW else n)
        torch.testing.assert_close(got_k[..., :n, :], want_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_v[..., :n, :], want_v, atol=1e-5, rtol=0)
        assert static.get_seq_length() == dynamic.get_seq_length()
    assert static.keys.shape[-1] == dynamic.keys.shape[-1] == RANK  # latents, not keys


def _alternating():
    """A tiny Gemma 2 (softcapped scores), a sliding layer of 4 tokens then a full one."""
    config = config_for("gemma2", head_dim=32)
    config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 4
    return build(config)


def test_low_rank_plans_sliding_layers_but_not_their_keys_before_rope():
    model = _alternating()
    report = lorc_fx.compress(model, 0.5, latent_bits=16, basis="weight", rope="commute",
                              progress=False)
    sliding = report.plan.layers[0]
    assert sliding.k_compressible and sliding.v_compressible
    assert report.plan.cache_fraction <= 0.5
    kept_full = lorc_fx.compress(_alternating(), 0.7, latent_bits=16, basis="weight",
                                 rope="reconstruct", progress=False)  # sliding keys as they come
    assert not kept_full.plan.layers[0].k_compressible
    assert kept_full.plan.layers[0].v_compressible
    assert "RoPE" in kept_full.plan.layers[0].note
    lowest = {}
    for rope in ("commute", "reconstruct"):
        with pytest.raises(UnreachableFraction) as refused:
            lorc_fx.compress(_alternating(), 0.01, latent_bits=16, basis="weight", rope=rope,
                             progress=False)
        lowest[rope] = refused.value.lowest
    # the sliding layer's keys as they come are a quarter of the float32 cache
    assert lowest["commute"] < 0.25 <= lowest["reconstruct"]


def test_sliding_latents_at_full_rank_generate_as_the_model_eager_and_compiled():
    """A prompt longer than the window, then steps past it, dynamic and static cache."""
    model = _alternating()
    ids, mask = prompt(length=10)
    expected = generate(model, ids, mask, new_tokens=6)
    report = lorc_fx.compress(model, 1.0, latent_bits=16, basis="weight", rope="commute",
                              progress=False)
    assert report.plan.layers[0].k_compressible and report.plan.layers[0].v_compressible
    for backend in (None, lorc_backend.with_options(inductor=False)):
        for cache, layer in ((None, LatentSlidingLayer), ("static", LatentStaticSlidingLayer)):
            with compiled(model, backend) if backend else contextlib.nullcontext():
                got = generate(model, ids, mask, cache, new_tokens=6)
            assert isinstance(got.past_key_values, LatentCache)
            assert isinstance(got.past_key_values.layers[0], layer)
            assert_same_generation(got, expected)
