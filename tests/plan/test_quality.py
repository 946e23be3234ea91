"""Data-aware bases, rank allocation and the evaluation harness, on tiny random Llamas.

The tiny model (``helpers.tiny_llama``, fixtures ``tiny`` and ``loaded`` in conftest.py) is
saved with a word-level tokenizer into a temporary directory, so every path a user takes
(``plan``, ``compress``, ``evaluate``, ``lorc eval``) runs as for a real model: no
downloads, a few seconds each.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.cache_utils import DynamicCache

from lorc_fx.plan import calibration
from lorc_fx.api import plan
from lorc_fx.cache import LatentCache, LatentCodec
from lorc_fx.data.texts import calibration_part, evaluation_part
from lorc_fx.plan.calibration import CalibrationOptions, collect
from lorc_fx.plan.planner import PlanOptions, plan_layers
from lorc_fx.plan.schedules import UnreachableFraction
from helpers.plan_inputs import random_layers
from helpers.tiny_llama import HEAD_DIM, HEADS, KV_HEADS


def calib(text: str) -> CalibrationOptions:
    return CalibrationOptions(texts=(text,), tokens=512, window=64)


def kv_outputs(model, blocks, windows):
    """Keys (post-RoPE, as the cache sees them) and values of every layer, flattened."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(windows, past_key_values=cache, use_cache=True)
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3]).double()
    return {b.layer: (flat(cache.layers[b.layer].keys), flat(cache.layers[b.layer].values))
            for b in blocks}


def test_split_is_disjoint_and_covers_the_text():
    text = "\n\n".join(f"p{i}" for i in range(10))
    cal, ev = calibration_part(text).split("\n\n"), evaluation_part(text).split("\n\n")
    assert cal == ["p0", "p4", "p8"] and not set(cal) & set(ev) and len(cal) + len(ev) == 10


def test_whitened_basis_reduces_the_data_weighted_error(loaded):
    model, tok, blocks, text = loaded
    windows = calibration.calibration_windows(tok, calib(text))
    states = kv_outputs(model, blocks, windows)

    def error(basis):
        p = plan(model, 0.5, basis=basis, schedule="uniform", calibration=calib(text), blocks=blocks)
        total = 0.0
        for l in p.layers:
            for x, b in ((states[l.layer][0], l.k_basis), (states[l.layer][1], l.v_basis)):
                total += float((x - x @ b.T @ b).square().sum())
        return total

    weight, whitened = error("weight"), error("whitened")
    assert whitened < 0.8 * weight


def test_auto_basis_uses_attention_when_it_can_calibrate(loaded, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tok, blocks, text = loaded
    assert plan(model, 0.75, calibration=calib(text), blocks=blocks,
                latent_bits=16).options.basis == "attention"
    bare = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "_name_or_path": ""})).eval()
    # no tokenizer: calibrated on the model's own samples, never the weight-only basis
    planned = plan(bare, 0.75, calibration=calib(text), blocks=blocks, latent_bits=16)
    assert planned.options.basis == "attention" and not planned.basis_note
    assert planned.options.calibration.texts == ("self",)


def test_calibration_is_cached_on_disk(loaded, monkeypatch):
    model, tok, blocks, text = loaded
    first = calibration.layer_statistics(model, blocks, calib(text), tok)
    monkeypatch.setattr(calibration, "collect", lambda *a, **k: pytest.fail("recomputed"))
    second = calibration.layer_statistics(model, blocks, calib(text), tok)
    for layer, stats in first.items():
        assert torch.equal(stats.input_gram, second[layer].input_gram)
        assert torch.equal(stats.attention.values, second[layer].attention.values)
    # other options are another calibration
    with pytest.raises(pytest.fail.Exception):
        calibration.layer_statistics(model, blocks, CalibrationOptions((text,), 512, seed=1,
                                                                       window=64), tok)


def test_probe_leaves_attention_unchanged_and_value_error_is_exact(loaded):
    """The probe's attention equals the model's own; dropping one value row changes the
    layer's attention output by exactly the energy the value spectrum assigns it."""
    from lorc_fx.plan.attention_probe import AttentionProbe, attention_modules
    from lorc_fx.plan.metrics import attention_value_spectrum

    model, tok, blocks, text = loaded
    windows = calibration.calibration_windows(tok, calib(text))[:2]
    with torch.no_grad():
        plain = model(windows, use_cache=False).logits
        with AttentionProbe(model, attention_modules(model, {b.layer: b.k.weight for b in blocks})):
            probed = model(windows, use_cache=False).logits
    torch.testing.assert_close(probed, plain, rtol=1e-4, atol=1e-4)

    moments = collect(model, blocks, windows)["attention"][0]
    from lorc_fx.plan.attention_probe import AttentionMoments
    moments = AttentionMoments(**moments)
    spectrum = attention_value_spectrum(moments, HEAD_DIM)
    o_proj = model.get_submodule(blocks[0].o.weight.rsplit(".", 1)[0])
    seen = []
    hook = o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(windows, use_cache=False)
            for drop in (spectrum.width - 1, 0):
                keep = [i for i in range(spectrum.width) if i != drop]
                codec = LatentCodec(None, spectrum.rows[keep].float(), KV_HEADS)
                cache = LatentCache.from_codecs(DynamicCache(config=model.config), {0: codec},
                                                prefill_as_stored=True)  # read back
                model(windows, past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    for drop, changed in zip((spectrum.width - 1, 0), seen[1:]):
        delta = (changed - seen[0]).double().reshape(-1, HEADS, HEAD_DIM)
        measured = float(delta.square().sum(-1).mean())
        predicted = float(spectrum.energy[drop]) * moments.output_energy
        assert measured == pytest.approx(predicted, rel=2e-3, abs=1e-9)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), schedule=st.sampled_from(["greedy", "calibrated"]),
       multiple=st.sampled_from([2, 4, 8]),
       fractions=st.lists(st.floats(0.55, 1.0), min_size=2, max_size=4))
def test_water_filling_meets_the_fraction_and_is_monotone(seed, schedule, multiple, fractions):
    layers = random_layers(seed)
    plans = [plan_layers(layers, PlanOptions(f, schedule, basis="weight", rank_multiple=multiple,
                                             key_fraction=0.9 if schedule == "calibrated" else None))
             for f in sorted(fractions)]
    full = sum(l.k_full + l.v_full for l in plans[0].layers)
    for p, f in zip(plans, sorted(fractions)):
        assert abs(p.cache_fraction - f) <= multiple / full + 1e-12
    if schedule == "calibrated":  # a fixed key split is moved into the range values can pay
        return                    # (between their least ranks and full width), so keys may rise
    for lower, higher in zip(plans, plans[1:]):
        for a, b in zip(lower.layers, higher.layers):
            assert a.k_rank <= b.k_rank and a.v_rank <= b.v_rank


def test_water_filling_drops_the_cheapest_rows_first():
    """With one layer's spectrum ten times weaker, that layer loses its rows first."""
    layers = random_layers(3, n_layers=2)
    layers[1].k_weight, layers[1].v_weight = layers[0].k_weight / 10, layers[0].v_weight / 10
    from lorc_fx.plan.spectra import real_spectrum, rope_commuting_spectrum

    for l in layers:  # energies in one unit across layers: the raw spectra
        l.k_spectrum = rope_commuting_spectrum(l.k_weight, 2, 8, l.rope)
        l.v_spectrum = real_spectrum(l.v_weight)
    p = plan_layers(layers, PlanOptions(0.75, "greedy", basis="weight", rank_multiple=2))
    assert p.layers[1].k_rank + p.layers[1].v_rank < p.layers[0].k_rank + p.layers[0].v_rank


def test_greedy_reports_the_reachable_range():
    layers = random_layers(0)
    # the first two layers kept (0.5) + one rank step of 2 on the others' four sides (8/128)
    with pytest.raises(UnreachableFraction, match=r"\[0\.562, 1\.000\]"):
        plan_layers(layers, PlanOptions(0.2, "greedy", keep_first=2, rank_multiple=2))


def test_evaluate_is_exact_at_full_fraction(loaded):
    from lorc_fx.api import compress
    from lorc_fx.eval.evaluate import EvalOptions, evaluate
    from lorc_fx.data.texts import load_text

    model, tok, blocks, text = loaded
    compress(model, 1.0, blocks=blocks, calibration=calib(text))
    result = evaluate(model, tok, load_text(text),
                      EvalOptions(tokens=256, window=64, prompts=2, new_tokens=6))
    assert result.ppl_compressed == pytest.approx(result.ppl_full, rel=1e-4)
    assert result.top1_agreement > 0.99 and result.generation["exact_match"] == 1.0


def test_pre_rope_attention_keys_are_oblique_and_exact_through_cache_and_graph(loaded):
    """Keys cached before RoPE get the query-weighted oblique basis (rebuild rows ≠ latent
    rows). At full rank the latent cache reproduces the model; below it the compiled rewrite
    reads the same latents as the eager cache."""
    from lorc_fx.compile.backend import lorc_backend
    from lorc_fx.api import compress
    from lorc_fx.cache import latent_cache

    model, tok, blocks, text = loaded
    ids = calibration.calibration_windows(tok, calib(text))[:2, :32]
    options = dict(rope="reconstruct", basis="attention", calibration=calib(text), blocks=blocks,
                   latent_bits=16)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        plan = compress(model, 1.0, **options).plan
        assert not torch.allclose(plan.layers[0].k_rebuild, plan.layers[0].k_basis)
        full = model(ids, past_key_values=latent_cache(model), use_cache=True).logits
        torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)

        compress(model, 0.75, **options)
        eager = model(ids, past_key_values=latent_cache(model), use_cache=True).logits
        torch._dynamo.reset()
        rewritten = torch.compile(model, backend=lorc_backend.with_options(inductor=False))
        got = rewritten(ids, past_key_values=latent_cache(model), use_cache=True).logits
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    assert (got - expected).abs().max() > 1e-3  # below full rank something was dropped


def test_auto_rope_keeps_the_mode_with_the_lower_held_out_loss(loaded):
    from lorc_fx.search.split import held_out_loss

    model, tok, blocks, text = loaded
    chosen = plan(model, 0.75, calibration=calib(text), blocks=blocks, latent_bits=16)
    other = plan(model, 0.75, calibration=calib(text), blocks=blocks, latent_bits=16,
                 rope={"commute": "reconstruct", "reconstruct": "commute"}[chosen.options.rope])
    assert held_out_loss(model, blocks, chosen) <= held_out_loss(model, blocks, other)


@pytest.mark.parametrize("latent_bits", ["auto", 16])
def test_default_plan_beats_the_paper_on_data_error(loaded, latent_bits):
    """The default (measured bit widths; with 16-bit latents: the attention basis and the
    calibrated split) keeps the calibration loss closer to the full model's than the paper's
    weight SVD with its progressive schedule."""
    from lorc_fx.search.split import calibration_loss

    model, tok, blocks, text = loaded
    windows = calibration.calibration_windows(tok, calib(text))
    full = calibration_loss(model, blocks, None, windows)
    # 0.75: with no layer below one rank step, the paper's schedule reaches 0.625 here
    paper = plan(model, 0.75, basis="weight", schedule="progressive", blocks=blocks)
    ours = plan(model, 0.75, calibration=calib(text), blocks=blocks, latent_bits=latent_bits)
    assert ours.scheme.name == "plain" or ours.options.key_fraction is not None
    assert (calibration_loss(model, blocks, ours, windows) - full
            < calibration_loss(model, blocks, paper, windows) - full)


def test_cli_eval_writes_the_json_keys(loaded, tmp_path):
    from lorc_fx.cli import main

    model, tok, blocks, text = loaded
    out = tmp_path / "eval.json"
    code = main(["eval", "--model", model.name_or_path, "--cache-fraction", "0.75",
                 "--text", text, "--tokens", "128", "--window", "64", "--prompts", "1",
                 "--new-tokens", "4", "--calibration-text", text, "--calibration-tokens", "512",
                 "--basis", "whitened", "--schedule", "greedy", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert {"ppl_full", "ppl_compressed", "ppl_ratio", "top1_agreement", "kl_mean",
            "generation", "cache_bytes_per_token_full", "cache_bytes_per_token_compressed",
            "plan"} <= set(data)
    assert data["cache_bytes_per_token_compressed"] < data["cache_bytes_per_token_full"]


def test_sweep_writes_rows_as_it_goes_and_resumes(loaded, tmp_path, monkeypatch):
    from lorc_fx.eval import sweep
    from lorc_fx.data.texts import load_text

    model, tok, blocks, text = loaded
    configs = sweep.parse_configs("weight:progressive,weight:greedy")
    out = str(tmp_path / "sweep.json")
    args = (model, tok, blocks, {"tiny": load_text(text)}, [0.75], configs, 128, 64)
    first = sweep.run_sweep(*args, progress=False, checkpoint=out)
    assert [r["schedule"] for r in first["rows"]] == ["progressive", "greedy"]
    assert all(r["ppl"]["tiny"] > 0 and r["kl"]["tiny"] > 0 and 0 < r["top1"]["tiny"] <= 1
               for r in first["rows"])
    monkeypatch.setattr(sweep, "compress", lambda *a, **k: pytest.fail("recomputed"))
    again = sweep.run_sweep(*args, progress=False, checkpoint=out)
    assert again["rows"] == first["rows"]
    sweep.plot_sweep(again, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000


@pytest.mark.slow
def test_default_options_keep_news_perplexity_on_the_real_model():
    """Default options at fraction 0.8 on held-out news, through the latent cache: the goal
    of x1.03 (measured on these 2048 tokens: x1.0171, top-1 0.912, calibrated on the model's
    own samples; x1.0070 with the news+Austen calibration, which has read news). Under 2 min
    with the calibration cached; its first run samples calibration text from the model,
    calibrates and measures the key/value split for both RoPE modes (~5 min on 2 cores)."""
    from lorc_fx.api import compress
    from lorc_fx.eval.evaluate import EvalOptions, evaluate
    from lorc_fx.data.models import ModelNotFoundError, load_model, load_tokenizer
    from lorc_fx.data.texts import load_text

    try:
        model, tok = load_model("default"), load_tokenizer("default")
    except ModelNotFoundError as err:
        pytest.skip(str(err))
    compress(model, 0.8)
    result = evaluate(model, tok, load_text("news"), EvalOptions(tokens=2048, prompts=1,
                                                                new_tokens=8))
    assert result.ppl_ratio <= 1.03
    assert result.top1_agreement > 0.85
