"""Calibration text sampled from the model itself (the default), and what happens where a
named calibration text or a tokenizer is missing, on the tiny Llama (a few seconds)."""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.cache_utils import DynamicLayer

from lorc_fx.analysis.cache_probe import fresh_cache
from lorc_fx.api import plan
from lorc_fx.plan import calibration, sampling
from lorc_fx.plan.calibration import CalibrationOptions, usable_calibration
from lorc_fx.report import plan_table

from helpers.families import build, config_for


def bare_copy(model, **config):
    """``model``'s architecture with fresh weights and no tokenizer to load."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "_name_or_path": "",
                                           **config})).eval()


def test_the_default_calibration_is_the_models_own_text():
    assert CalibrationOptions().texts == ("self",)


def test_sampling_starts_from_bos_else_eos_else_cls_else_padding():
    """A BERT-style decoder (RoCBert) names neither BOS nor EOS: its text is sampled from
    CLS, else its padding token, instead of falling back to the weight-only basis."""
    from types import SimpleNamespace as Config

    model = lambda **ids: Config(config=Config(**ids), generation_config=None)
    assert sampling.start_token(model(eos_token_id=2, pad_token_id=0),
                                Config(bos_token_id=None, eos_token_id=None)) == 2
    assert sampling.start_token(model(pad_token_id=0), Config(cls_token_id=101)) == 101
    assert sampling.start_token(model(pad_token_id=0)) == 0
    assert sampling.start_token(model()) is None


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 300),
       temperature=st.floats(0.05, 20.0), top_p=st.floats(0.05, 1.0))
def test_nucleus_pick_matches_a_full_sort(seed, vocab, temperature, top_p):
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(6, vocab, generator=gen, dtype=torch.float64) / temperature).softmax(-1)
    u = torch.rand(6, generator=gen, dtype=torch.float64)
    values, order = probs.sort(-1, descending=True)
    expected = sampling._pick_sorted(values, order, top_p, u)
    for tiers in ((2, 8), (1,), ()):  # every row through every tier, and sorted outright
        sampling._NUCLEUS_CANDIDATES = tiers
        try:
            assert torch.equal(sampling.nucleus_pick(probs, top_p, u), expected)
        finally:
            sampling._NUCLEUS_CANDIDATES = (512, 4096)
    # only nucleus tokens are picked: those whose preceding mass is below top_p
    before = values.cumsum(-1) - values
    rank = (order == expected).double().argmax(-1)
    assert (before.gather(-1, rank[:, None]) < top_p).all()


@pytest.mark.parametrize("family", ["llama", "gemma3", "lfm2"])
def test_sampling_reads_its_preallocated_layers_as_a_growing_cache(family, monkeypatch):
    # gemma3: sliding-window layers beside full ones; lfm2: convolution layers (kept as built)
    model = build(config_for(family))
    kinds = {type(layer) for layer in getattr(sampling.sampling_cache(model, 8), "layers", [])}
    assert DynamicLayer not in kinds and (family == "lfm2" or sampling._Preallocated in kinds)
    preallocated = sampling.sample_sequences(model, 1, 24, [0, 1, 2])
    monkeypatch.setattr(sampling, "sampling_cache", lambda model, capacity: fresh_cache(model))
    assert torch.equal(sampling.sample_sequences(model, 1, 24, [0, 1, 2]), preallocated)


def test_self_generated_windows_are_cached_and_do_not_depend_on_the_count(loaded, monkeypatch,
                                                                          caplog):
    model, tok, blocks, text = loaded
    with caplog.at_level(logging.INFO, logger=calibration.__name__):
        two = calibration.self_generated_windows(model, tok, 2, 16, seed=3)
    assert two.shape == (2, 16) and (two[:, 0] == tok.bos_token_id).all()
    # says once that it samples, and where it keeps the samples
    (record,) = [r for r in caplog.records if "sampling" in r.getMessage()]
    path = calibration.self_cache_path(model, tok.bos_token_id, 16, 3)
    assert str(path.parent) in record.getMessage() and path.is_file()
    monkeypatch.setattr(calibration, "SELF_BATCH", 1)  # another batching: the same sequences
    three = calibration.self_generated_windows(model, tok, 3, 16, seed=3)
    assert torch.equal(three[:2], two)
    other = calibration.calibration_windows(tok, CalibrationOptions(("self", text), 64, seed=4,
                                                                    window=16), model)
    assert other.shape == (4, 16) and not torch.equal(other[:2], three[:2])
    monkeypatch.setattr(calibration, "sample_sequences", lambda *a, **k: pytest.fail("resampled"))
    assert torch.equal(calibration.self_generated_windows(model, tok, 3, 16, seed=3), three)
    assert torch.equal(calibration.self_generated_windows(model, None, 2, 16, seed=3), two)


def test_a_missing_text_becomes_self_and_auto_never_falls_back_to_weight(loaded):
    model, tok, blocks, text = loaded
    options = CalibrationOptions(texts=(text, "/nonexistent/corpus.txt"), tokens=512, window=64)
    assert usable_calibration(model, options).texts == (text, "self")
    assert usable_calibration(model, CalibrationOptions((text,))).texts == (text,)
    # no tokenizer at all: the model's own samples still calibrate it
    p = plan(bare_copy(model), 0.75, calibration=options, blocks=blocks, latent_bits=16)
    assert p.options.basis == "attention" and p.options.calibration.texts == ("self",)
    assert "calibrated on 512 tokens (text sampled from the model itself" in plan_table(p)


def test_the_weight_basis_says_so_in_the_report(loaded, caplog):
    model, tok, blocks, text = loaded
    asked = plan(model, 0.75, basis="weight", blocks=blocks)
    assert "weight-only SVD" in plan_table(asked) and "as asked" in plan_table(asked)
    assert "weight-only SVD" in asked.to_json()["basis_note"]
    # nothing to sample from (no BOS/EOS/CLS/padding) and no tokenizer: the one case auto
    # cannot calibrate
    silent = bare_copy(model, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with caplog.at_level(logging.WARNING):
        fallback = plan(silent, 0.75, blocks=blocks,
                        calibration=CalibrationOptions(tokens=128, window=16))
    assert fallback.options.basis == "weight"
    assert "no calibration was possible" in plan_table(fallback)
    assert "BOS, EOS, CLS or padding" in plan_table(fallback)
    assert any("falls back to 'weight'" in r.getMessage() for r in caplog.records)


def test_a_first_plan_samples_calibration_and_held_out_text_in_one_pass(loaded, monkeypatch):
    model, tok, blocks, text = loaded
    real, batches = calibration.sample_sequences, []

    def counting(model, start, length, seeds, step=None):
        batches.append(len(seeds))
        return real(model, start, length, seeds, step)

    monkeypatch.setattr(calibration, "sample_sequences", counting)
    p = plan(model, 0.75, calibration=CalibrationOptions(tokens=256, window=32), blocks=blocks,
             latent_bits=16)
    assert p.options.basis == "attention" and p.options.key_fraction is not None
    assert batches == [8 + 8]  # calibration and held-out windows (another seed), side by side


def test_a_first_plan_says_what_it_measures_where_it_keeps_it_and_how_long_it_took(loaded,
                                                                                 caplog):
    model, tok, blocks, text = loaded
    with caplog.at_level(logging.WARNING):
        plan(model, 0.75, blocks=blocks, rope="commute")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    (first,) = [m for m in said if "first plan of" in m]
    where = str(calibration.user_cache_dir() / "calibration")
    assert "sampling text from the model" in first and where in first and "report.save" in first
    # a float32 model at 0.75 fits plain 8-bit quantization: measured first, low rank only if
    # it costs more than noise
    assert "plain 8- and 4-bit KV quantization" in first and "unless one is within noise" in first
    (done,) = [m for m in said if "first plan made in" in m]
    assert where in done
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan(model, 0.5, blocks=blocks, rope="commute")  # calibrated before: nothing to say
    assert not [r for r in caplog.records if "plan" in r.getMessage()]
