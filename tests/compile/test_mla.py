"""MLA (DeepSeek-V2/V3 and the families built from them): transformers 5.23 caches one
normalised latent and a RoPE key shared by the heads, and expands both into every head's keys
and values at every step. ``absorb_mla`` finds that expansion by data flow and reads attention
over the latent instead, the up-projection folded into query and output: exact, whatever
stores the latent."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import lorc_fx
from helpers.families import build, config_for
from helpers.pass_helpers import assert_same_generation, compiled, generate, prompt
from lorc_fx.analysis.attention_match import MLA_REASON
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.compile.mla_attention import mla_attention, mla_scores, mla_sums


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))


def expanded_attention(query, latent, rope_key, weight, d_n, **sdpa):
    """transformers' reading: every head's keys and values expanded from the latent."""
    b, h = query.shape[:2]
    n = latent.shape[2]
    kv = F.linear(latent, weight).view(b, n, h, -1).transpose(1, 2)
    k_nope, value = kv.split([d_n, kv.shape[-1] - d_n], dim=-1)
    key = torch.cat((k_nope, rope_key.expand(-1, h, -1, -1)), dim=-1)
    return F.scaled_dot_product_attention(query, key, value, **sdpa)


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), d_n=st.sampled_from([4, 8]), d_r=st.sampled_from([2, 4]),
       d_v=st.sampled_from([4, 8]), rank=st.sampled_from([4, 16]), t=st.integers(1, 4),
       past=st.integers(0, 6), mask=st.sampled_from([None, "bool", "float", "causal"]),
       scale=st.sampled_from([None, 0.3]), rows=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_mla_attention_is_attention_over_the_expanded_latent(heads, d_n, d_r, d_v, rank, t,
                                                              past, mask, scale, rows, seed):
    g = torch.Generator().manual_seed(seed)
    b, n = 2, t + past
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    args = (rnd(b, heads, t, d_n + d_r), rnd(b, 1, n, rank), rnd(b, 1, n, d_r),
            rnd(heads * (d_n + d_v), rank), d_n)
    sdpa = dict(scale=scale)
    if mask == "causal":
        sdpa["is_causal"] = True
    elif mask == "bool":
        keep = torch.rand(b, 1, t, n, generator=g) > 0.4
        keep[..., 0] = True
        sdpa["attn_mask"] = keep
    elif mask == "float":
        sdpa["attn_mask"] = rnd(b, 1, t, n)
    torch.testing.assert_close(mla_attention(*args, **sdpa, heads_as_rows=rows),
                               expanded_attention(*args, **sdpa),
                               atol=1e-10, rtol=1e-10)


@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 4), d_n=st.sampled_from([4, 8]), d_r=st.sampled_from([2, 4]),
       d_v=st.sampled_from([4, 8]), rank=st.sampled_from([4, 16]), t=st.integers(1, 4),
       past=st.integers(0, 6), seed=st.integers(0, 2 ** 16))
def test_mla_scores_and_sums_are_manual_attention_over_the_expanded_latent(
        heads, d_n, d_r, d_v, rank, t, past, seed):
    g = torch.Generator().manual_seed(seed)
    b, n = 2, t + past
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    query, latent, rope_key = rnd(b, heads, t, d_n + d_r), rnd(b, 1, n, rank), rnd(b, 1, n, d_r)
    weight, probs = rnd(heads * (d_n + d_v), rank), rnd(b, heads, t, n).softmax(-1)
    kv = F.linear(latent, weight).view(b, n, heads, -1).transpose(1, 2)
    key = torch.cat((kv[..., :d_n], rope_key.expand(-1, heads, -1, -1)), dim=-1)
    torch.testing.assert_close(mla_scores(query, latent, rope_key, weight, d_n),
                               query @ key.transpose(2, 3), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(mla_sums(probs, latent, weight, d_n), probs @ kv[..., d_n:],
                               atol=1e-10, rtol=1e-10)


def eager_and_compiled(model, backend, new_tokens: int):
    """The model's greedy generation of a left-padded batch compiled with ``backend``, and
    eager."""
    ids, mask = prompt(2, 12)
    expected = generate(model, ids, mask, new_tokens=new_tokens)
    with compiled(model, backend):
        return generate(model, ids, mask, new_tokens=new_tokens), expected


def continued(model, ids, mask):
    """Generate, then go on from the returned cache with the tokens it gave."""
    first = generate(model, ids, mask, new_tokens=2)
    more = torch.cat((mask, torch.ones_like(first.sequences[:, ids.shape[1]:])), dim=1)
    return generate(model, first.sequences, more, new_tokens=3,
                    past_key_values=first.past_key_values)


MODES = {
    "greedy": lambda m, ids, mask: generate(m, ids, mask, new_tokens=4),
    "beams": lambda m, ids, mask: generate(m, ids, mask, new_tokens=3, num_beams=2),
    "static": lambda m, ids, mask: generate(m, ids, mask, cache="static", new_tokens=4),
    "continued": continued,
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mla_read_absorbed_generates_the_models_tokens(mode):
    """Rewritten graph run as it is (every graph: prefill, decode, beams' reorder)."""
    model = build(config_for("deepseek_v3"))
    ids, mask = prompt(2, 12)
    expected = MODES[mode](model, ids, mask)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        got = MODES[mode](model, ids, mask)
    assert_same_generation(got, expected, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert backend.reports and all(r.counts["absorb_mla"] == layers for r in backend.reports)


def test_mla_in_manual_attention_is_read_absorbed():
    """transformers' eager attention (its two matmuls, the mask between) over MLA's expansion:
    both products rewritten, the model's tokens."""
    config = config_for("deepseek_v3")
    config._attn_implementation = "eager"
    model = build(config)
    assert model.config._attn_implementation == "eager"
    report = lorc_fx.compress(model, cache_fraction=1.0, progress=False)
    assert MLA_REASON in report.left_alone
    backend = lorc_backend.with_options(inductor=False)
    assert_same_generation(*eager_and_compiled(model, backend, 4), atol=1e-5, rtol=1e-5)
    assert all(r.counts["absorb_mla"] == config.num_hidden_layers for r in backend.reports)


@pytest.mark.parametrize("coded", [False, True], ids=["float cache", "int8 codes"])
def test_mla_read_absorbed_through_inductor(coded):
    """Through Inductor, the float cache and the plain plan's codes (the latent dequantized,
    then read absorbed) each give the eager model's tokens."""
    model = build(config_for("deepseek_v3"))
    if coded:
        report = lorc_fx.compress(model, cache_fraction=0.3, progress=False)
        assert MLA_REASON in str(report)
    backend = lorc_backend.with_options()
    assert_same_generation(*eager_and_compiled(model, backend, 4), atol=1e-5, rtol=1e-5)
    assert all(r.counts["absorb_mla"] == model.config.num_hidden_layers for r in backend.reports)


def test_an_up_projection_with_a_bias_is_not_absorbed():
    """A bias on the up-projection is outside the pattern: left as it is, not called MLA."""
    model = build(config_for("deepseek_v3"))
    for layer in model.model.layers:
        proj = layer.self_attn.kv_b_proj
        proj.bias = nn.Parameter(torch.randn(proj.out_features))
    report = lorc_fx.compress(model, cache_fraction=1.0, progress=False)
    assert MLA_REASON not in report.left_alone
    backend = lorc_backend.with_options(inductor=False)
    assert_same_generation(*eager_and_compiled(model, backend, 3), atol=1e-6, rtol=1e-6)
    assert all(r.counts["absorb_mla"] == 0 for r in backend.reports)
