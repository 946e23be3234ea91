"""The compiler pass end to end on random architectures: latent cache + rewrite.

Most examples run the rewritten graph directly (``inductor=False``); ``test_inductor_*``
compile a fixed few through Inductor.
"""
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers.cache_utils import DynamicSlidingWindowLayer

from lorc_fx.compile.backend import lorc_backend
from lorc_fx.api import compress
from lorc_fx.cache import LatentCache, latent_cache
from lorc_fx.plan.schedules import UnreachableFraction
from helpers.families import FAMILIES, architectures, build, config_for
from helpers.pass_helpers import assert_same_generation, compiled, generate, prompt

REWRITE_ONLY = lorc_backend.with_options(inductor=False)
SETTINGS = settings(max_examples=8, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ROPE_MODES = st.sampled_from(["commute", "reconstruct"])
CACHES = st.sampled_from([None, "static"])


@SETTINGS
@given(arch=architectures(), rope=ROPE_MODES, cache=CACHES, seed=st.integers(0, 100))
def test_full_fraction_compiled_matches_uncompressed_eager(arch, rope, cache, seed):
    family, config = arch
    model = build(config, seed)
    ids, mask = prompt(seed=seed)
    expected = generate(model, ids, mask, cache)
    compress(model, 1.0, basis="weight", rope=rope)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        got = generate(model, ids, mask, cache)
    assert isinstance(got.past_key_values, LatentCache)
    assert_same_generation(got, expected)
    if family != "gemma3":  # gemma3: keys behind a norm stay raw
        assert sum(r.absorbed for r in backend.reports) > 0, "no attention was rewritten"


def expected_cache_bytes(report, cache) -> int:
    batch, tokens = cache.layers[0].keys.shape[0], cache.get_seq_length()
    if cache.layers[0].get_max_length() > 0:  # static: the whole buffer is held
        tokens = cache.layers[0].get_max_length()
    return batch * int(tokens) * report.cache_bytes_per_token()[1]


@SETTINGS
@given(arch=architectures(families=[f for f in FAMILIES if f != "gemma3"]), rope=ROPE_MODES,
       cache=CACHES, fraction=st.floats(0.2, 0.95), seed=st.integers(0, 100))
def test_compressed_compiled_matches_eager_latent_and_cache_shrinks(arch, rope, cache, fraction,
                                                                     seed):
    _, config = arch
    model = build(config, seed)
    ids, mask = prompt(seed=seed)
    try:
        report = compress(model, fraction, basis="weight", schedule="uniform", rope=rope,
                          rank_multiple=1)
    except UnreachableFraction as err:  # a tiny model's least ranks (and RoPE angle log)
        assert fraction < err.lowest    # can outweigh the budget
        return
    assert all(l.k_rank > 0 and l.v_rank > 0 for l in report.plan.layers)  # no side zeroed
    eager = generate(model, ids, mask, cache)
    with compiled(model, REWRITE_ONLY):
        got = generate(model, ids, mask, cache)
    assert_same_generation(got, eager)
    measured = got.past_key_values.cache_bytes()
    assert measured == eager.past_key_values.cache_bytes()
    assert measured == expected_cache_bytes(report, got.past_key_values)
    full, kept = report.plan.cache_elements_per_token()
    assert kept < full


def test_latent_cache_keeps_beam_search_and_cropping():
    model = build(config_for("llama", heads=4, kv_heads=2))
    ids, mask = prompt()
    expected = generate(model, ids, mask, num_beams=3)
    compress(model, 1.0, basis="weight")
    got = generate(model, ids, mask, num_beams=3)
    assert torch.equal(got.sequences, expected.sequences)
    cache = got.past_key_values
    length = cache.get_seq_length()
    cache.crop(-2)
    assert cache.get_seq_length() == length - 2
    assert all(layer.keys.shape[-2] == length - 2 for layer in cache.layers)


@pytest.mark.parametrize("family, layers", [("gemma3", 2), ("mistral", 2)])
@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
def test_report_is_what_the_generated_cache_holds(family, layers, rope):
    """Sliding-window layers hold latents as full layers do, but keys cached before RoPE
    (``reconstruct``), which they keep as they come; the report's bytes per token equal those
    measured from generate's cache (a context within the window, where a sliding layer holds
    every token)."""
    config = config_for(family, layers=layers)
    if family == "mistral":
        config.sliding_window, config.layer_types = 4, ["sliding_attention", "full_attention"]
    model = build(config)
    report = compress(model, 0.8, schedule="uniform", basis="weight", rope=rope)
    ids, _ = prompt(batch=2)
    out = model.generate(ids[:, :3], max_new_tokens=1, min_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    assert "sliding_attention" in report.plan.layers[0].note
    sliding, full = report.plan.layers  # keys behind a norm: no weight basis, in either
    assert sliding.v_compressible
    assert sliding.k_compressible == (rope == "commute" and full.k_compressible)
    tokens = cache.get_seq_length() * ids.shape[0]
    assert tokens <= 2 * model.config.sliding_window
    assert cache.cache_bytes() / tokens == report.cache_bytes_per_token()[1]
    assert report.plan.cache_fraction <= 0.8 + 2 * 8 / sum(l.k_full + l.v_full
                                                         for l in report.plan.layers)


@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_backend_compresses_an_uncompressed_model(rope, fraction):
    """``torch.compile(model, backend=...)`` alone: same logits as the eager latent cache."""
    model = build(config_for("qwen2", heads=4, kv_heads=2, layers=2))
    ids, _ = prompt(batch=1)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        backend = lorc_backend.with_options(inductor=False, cache_fraction=fraction,
                                            schedule="uniform", rope=rope)
        torch._dynamo.reset()
        got = torch.compile(model, backend=backend)(ids, use_cache=False).logits
        compress(model, fraction, basis="weight", schedule="uniform", rope=rope)
        eager = model(ids, past_key_values=latent_cache(model), use_cache=True).logits
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    if fraction == 1.0:
        torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    else:
        assert (got - plain).abs().max() > 1e-3  # really compressed
    assert [r.compression.compressed for r in backend.reports] == [[0, 1]]


def test_backend_leaves_full_cache_attention_alone_and_says_why():
    model = build(config_for("llama"))
    ids, mask = prompt()
    expected = generate(model, ids, mask)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        got = generate(model, ids, mask)
    assert_same_generation(got, expected)
    reasons = [why for r in backend.reports if r.compression for _, why in r.compression.left_alone]
    assert reasons and all("lorc_fx.compress" in why for why in reasons)


def test_backend_is_registered_by_name():
    model = build(config_for("gpt2", heads=2, kv_heads=2, layers=1))
    ids, _ = prompt(batch=1)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="lorc")  # resolves the name without compiling yet
    assert "lorc" in torch._dynamo.list_backends(exclude_tags=())


def test_rewrite_keeps_in_place_cache_writes():
    """The static cache writes latents with index_copy_; no rewrite may drop those nodes."""
    model = build(config_for("llama"))
    compress(model, 0.5, basis="weight", schedule="uniform")
    graphs = []

    def spy(gm, example_inputs):
        fn = REWRITE_ONLY(gm, example_inputs)
        graphs.append(gm)
        return fn

    ids, mask = prompt()
    eager = generate(model, ids, mask, "static")
    with compiled(model, spy):
        got = generate(model, ids, mask, "static")
    writes = [n for gm in graphs for n in gm.graph.nodes if n.target == "index_copy_"]
    assert len(writes) >= 2 * model.config.num_hidden_layers
    for a, b in zip(got.past_key_values.layers, eager.past_key_values.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.inductor
@pytest.mark.parametrize("family, fraction, cache", [("llama", 0.5, None), ("gpt2", 1.0, "static")])
def test_inductor_matches_eager(family, fraction, cache):
    model = build(config_for(family, heads=4, kv_heads=2 if family == "llama" else 4))
    ids, mask = prompt()
    expected = generate(model, ids, mask, cache)
    compress(model, fraction, basis="weight", schedule="uniform")
    if fraction < 1.0:
        expected = generate(model, ids, mask, cache)
    with compiled(model, lorc_backend):
        got = generate(model, ids, mask, cache)
    assert_same_generation(got, expected)


@pytest.mark.inductor
def test_inductor_compresses_an_uncompressed_model():
    """The pass's new bases are buffers AOT autograd can trace (each needs a dynamo source)."""
    model = build(config_for("llama", heads=4, kv_heads=2, layers=2))
    ids, _ = prompt(batch=1)
    options = dict(cache_fraction=0.5, schedule="uniform")
    with torch.no_grad():
        torch._dynamo.reset()
        rewritten = torch.compile(model, backend=lorc_backend.with_options(inductor=False, **options))
        expected = rewritten(ids, use_cache=False).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend=lorc_backend.with_options(**options))(
            ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_backend_says_once_what_changed_outputs(caplog):
    """Compressing an uncompressed model's attention is said once, at WARNING; attention left
    alone is said once per reason, however many graphs generate compiles."""
    model = build(config_for("llama"))
    ids, mask = prompt()
    backend = lorc_backend.with_options(inductor=False, cache_fraction=0.5, schedule="uniform")
    with caplog.at_level(logging.INFO, logger="lorc_fx.compile.backend"), torch.no_grad():
        torch._dynamo.reset()
        model.compile(backend=backend)
        model(ids, use_cache=False)
        generate(model, ids, mask)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(set(messages))
    compressed = [m for m in messages if "no lorc_fx.compress plan" in m]
    assert len(compressed) == 1 and "cache fraction 0.500" in compressed[0]
    assert sum("left uncompressed" in m for m in messages) == 1
    assert len(backend.reports) > 2  # several graphs compiled, each reported


def test_skipped_layers_store_full_keys_and_values():
    model = build(config_for("llama", heads=4, kv_heads=2, layers=3))
    ids, mask = prompt()
    compress(model, 0.8, basis="weight", schedule="uniform", keep_first=1, rank_multiple=1)
    cache = generate(model, ids, mask).past_key_values
    first, second = cache.layers[0], cache.layers[1]
    assert type(first).__name__ == "DynamicLayer" and first.keys.shape[1] == 2  # (b, h_kv, n, d)
    assert type(second).__name__ == "LatentDynamicLayer" and second.keys.shape[1] == 1


@pytest.mark.parametrize("rope", ["commute", "reconstruct", "speed"])
@pytest.mark.parametrize("decoding", ["prompt_lookup", "assisted"])
@pytest.mark.parametrize("compile_it", [False, True])
def test_draft_decoding_at_full_fraction_matches_uncompressed(rope, decoding, compile_it):
    """Assisted and prompt-lookup decoding crop the cache on rejected drafts: the latents
    and the RoPE angle log must be cropped together (eager and compiled). ``speed``: keys
    before RoPE in a RoPE-commuting basis, which compiled decode scores per rotary pair."""
    model = build(config_for("llama", heads=4, kv_heads=2))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    mask = torch.ones_like(ids)
    kwargs = ({"prompt_lookup_num_tokens": 2} if decoding == "prompt_lookup"
              else {"assistant_model": build(config_for("llama", heads=4, kv_heads=2), seed=1)})
    expected = generate(model, ids, mask, new_tokens=30)
    compress(model, 1.0, basis="weight",
             **(dict(objective="speed") if rope == "speed" else dict(rope=rope)))
    if compile_it:
        with compiled(model, REWRITE_ONLY):
            got = generate(model, ids, mask, new_tokens=30, **kwargs)
    else:
        got = generate(model, ids, mask, new_tokens=30, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
