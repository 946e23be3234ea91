"""A compressed model's plan saved to a file and installed again without planning.

Tiny random Llamas (weight basis, uniform schedule: no calibration) in both RoPE modes, and
one data-aware plan (attention basis, pre-RoPE oblique keys) on a tiny Llama with a
tokenizer. The reinstalled plan must give the same logits through the latent cache, bit
for bit.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

import lorc_fx
from lorc_fx import api
from lorc_fx.cache import latent_cache
from lorc_fx.plan import plan_file
from lorc_fx.plan.plan_file import PLAN_FILE, PlanFileError
from helpers.families import build, config_for
from helpers.tiny_llama import save_tiny_llama, write_text

FAST = dict(schedule="uniform", basis="weight")


def tiny(seed: int = 0, **config):
    return build(config_for("llama", **config), seed)


def latent_logits(model, seed: int = 0) -> torch.Tensor:
    """Logits of a prefill and of two decode steps through a fresh latent cache."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, 10), generator=gen)
    cache = latent_cache(model)
    with torch.no_grad():
        out = [model(ids[:, :8], past_key_values=cache, use_cache=True).logits]
        for step in (8, 9):
            out.append(model(ids[:, step:step + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def assert_same_plan(got, expected):
    assert got.options == expected.options
    assert got.reachable == pytest.approx(expected.reachable)
    assert got.rotary_log == expected.rotary_log
    assert got.basis_note == expected.basis_note  # the report's basis: line survives the file
    assert got.fingerprint == expected.fingerprint and got.fingerprint is not None
    assert (got.dtype_bits, got.scheme.name, got.candidates) == \
        (expected.dtype_bits, expected.scheme.name, expected.candidates)
    assert got.bits_per_value == expected.bits_per_value
    assert len(got.layers) == len(expected.layers)
    for a, b in zip(got.layers, expected.layers):
        assert a.summary() == b.summary()
        for name in ("k_basis", "v_basis", "k_rebuild", "v_rebuild"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.fixture
def forbid_planning(monkeypatch):
    """Call it once the plan is saved: from then on ``compress`` planning (and so
    calibrating) fails the test."""
    return lambda: monkeypatch.setattr(api, "_planned",
                                       lambda *a, **k: pytest.fail("planned again"))


@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
def test_saved_plan_installs_without_planning_and_gives_the_same_logits(rope, tmp_path, caplog,
                                                                         forbid_planning):
    model = tiny()
    report = lorc_fx.compress(model, 0.5, rope=rope, rank_multiple=1, **FAST)
    with caplog.at_level(logging.INFO, logger="lorc_fx"):
        path = report.save(tmp_path)  # a directory: the default file name inside it
    assert path == tmp_path / PLAN_FILE and path.is_file()
    assert [r.getMessage() for r in caplog.records if "wrote" in r.getMessage()] == [
        f"wrote LoRC plan of 2 layers (cache fraction {report.plan.cache_fraction:.4f}, "
        f"LlamaForCausalLM) to {path}"]

    forbid_planning()
    again = tiny()  # the same weights, another instance
    loaded = lorc_fx.compress(again, plan=path)
    assert_same_plan(loaded.plan, report.plan)
    assert loaded.plan.options.rope == rope
    assert loaded.cache_bytes_per_token() == report.cache_bytes_per_token()
    assert torch.equal(latent_logits(again), latent_logits(model))


def test_a_version_4_plan_is_read_with_the_smaller_angle_log(tmp_path, forbid_planning):
    """Up to version 4 the angle log held cos and sin (rotary_dim a token); its plan reads back
    with an angle and a magnitude per pair (rotary_dim / 2 + 1), what the cache now holds."""
    model = tiny()
    report = lorc_fx.compress(model, 0.5, rope="reconstruct", rank_multiple=1, **FAST)
    path = report.save(tmp_path / "p.safetensors")
    rotary_dim = model.config.head_dim
    assert report.plan.rotary_log == rotary_dim // 2 + 1
    _rewrite_metadata(path, lambda d, t: d.update(version=4, rotary_log=rotary_dim))
    forbid_planning()
    again = tiny()
    assert lorc_fx.compress(again, plan=path).plan.rotary_log == rotary_dim // 2 + 1
    cache = latent_cache(again)
    with torch.no_grad():
        again(torch.arange(3, 13)[None], past_key_values=cache, use_cache=True)
    assert cache.bits_per_value() == pytest.approx(again._lorc_plan.bits_per_value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A compressed tiny model, its blocks and report, and its plan saved to a file."""
    model = tiny()
    blocks = lorc_fx.analyze(model)
    report = lorc_fx.compress(model, 0.75, blocks=blocks, **FAST)
    return model, blocks, report, report.save(tmp_path_factory.mktemp("saved") / "p.safetensors")


def test_save_plan_takes_a_model_a_report_or_a_plan(saved, tmp_path):
    model, blocks, report, _ = saved
    paths = [lorc_fx.save_plan(model, tmp_path / "model.safetensors"),
             lorc_fx.save_plan(report, tmp_path / "report.safetensors"),
             lorc_fx.save_plan(report.plan, tmp_path / "plan.safetensors")]
    for path in paths:
        assert_same_plan(lorc_fx.load_plan(path, model, blocks), report.plan)
    with pytest.raises(ValueError, match="was not compressed"):
        lorc_fx.save_plan(tiny(), tmp_path / "none.safetensors")


def test_the_same_weights_loaded_elsewhere_in_another_dtype_fit(saved, tmp_path, forbid_planning):
    from transformers import AutoModelForCausalLM

    model, _, _, path = saved
    forbid_planning()
    model.save_pretrained(tmp_path / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16)
    lorc_fx.compress(reloaded, plan=path)
    assert reloaded._lorc_plan.fingerprint == model._lorc_plan.fingerprint


def test_a_plan_for_another_model_is_refused_naming_the_file(saved, forbid_planning):
    path = saved[-1]  # the plan of tiny(seed=0)
    forbid_planning()
    other = tiny(seed=1)  # same architecture, other weights
    with pytest.raises(ValueError, match=r"p\.safetensors is a plan for LlamaForCausalLM "
                                         r"\(fingerprint [0-9a-f]{16}\), not for this"):
        lorc_fx.compress(other, plan=path)
    assert not hasattr(other, "_lorc_plan")
    with pytest.raises(ValueError, match="fingerprint"):
        lorc_fx.load_plan(path, other)
    with pytest.raises(ValueError, match="fingerprint"):
        lorc_fx.compress(tiny(seed=0, kv_heads=4), plan=path)


def test_a_plan_whose_layers_are_not_the_models_is_refused(forbid_planning):
    """Without a fingerprint (an in-memory plan) the layers are still checked."""
    from dataclasses import replace

    planned = replace(lorc_fx.plan(tiny(), 0.75, **FAST), fingerprint=None)
    forbid_planning()
    with pytest.raises(ValueError, match="plans attention layers"):
        lorc_fx.compress(tiny(layers=3), plan=planned)
    with pytest.raises(ValueError, match="num_kv_heads 2 in the plan, 4 in the model"):
        lorc_fx.compress(tiny(kv_heads=4), plan=planned)


def test_a_plan_keeping_a_sliding_layer_raw_installs_from_its_file(tmp_path, forbid_planning):
    """A low-rank plan caching keys before RoPE keeps a sliding-window layer's keys raw,
    which the model could compress: installed from its file it fits and gives the same
    logits."""
    model = build(config_for("qwen2_sliding", layers=2))  # layer 1 slides
    report = lorc_fx.compress(model, 0.75, **{**FAST, "rope": "reconstruct"})
    assert not report.plan.layers[1].k_compressible and report.plan.layers[1].v_compressible
    expected = latent_logits(model)
    path = report.save(tmp_path / "sliding.safetensors")
    forbid_planning()
    lorc_fx.compress(model, plan=path)
    torch.testing.assert_close(latent_logits(model), expected, rtol=0, atol=0)


def test_plan_options_next_to_a_saved_plan_are_refused(saved):
    model, blocks, _, path = saved
    with pytest.raises(ValueError, match="cache_fraction, schedule cannot change it"):
        lorc_fx.compress(model, 0.5, plan=path, schedule="greedy", blocks=blocks)


def _rewrite_metadata(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        data = json.loads(f.metadata()[plan_file.FORMAT])
    edit(data, tensors)
    save_file(tensors, str(path), metadata={plan_file.FORMAT: json.dumps(data)})


@pytest.mark.parametrize("damage, message", [
    ("missing", "no LoRC plan file at"),
    ("garbage", "corrupt or not a plan file"),
    ("truncated", "corrupt or not a plan file"),
    ("no_metadata", "not a LoRC plan"),
    ("newer", f"format version {plan_file.VERSION + 1}"),
    ("tensor_gone", "lacks the tensor '0.k_basis'"),
    ("wrong_shape", r"tensor '1.v_basis' is torch.float64 \(3, 32\), the plan says"),
    ("field_gone", "corrupt or not a plan file"),
    ("widths_short", "layer 0's k code covers 1 rows of"),
])
def test_a_missing_or_damaged_file_is_a_clear_error_naming_it(damage, message, saved, tmp_path,
                                                              forbid_planning):
    import shutil

    model, blocks, report, original = saved
    path = tmp_path / "p.safetensors"
    shutil.copy(original, path)
    forbid_planning()
    if damage == "missing":
        path = tmp_path / "elsewhere.safetensors"
    elif damage == "garbage":
        path.write_bytes(b"not a safetensors file at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "no_metadata":
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(2)}, str(path))
    elif damage == "newer":
        _rewrite_metadata(path, lambda d, t: d.update(version=plan_file.VERSION + 1))
    elif damage == "tensor_gone":
        _rewrite_metadata(path, lambda d, t: t.pop("0.k_basis"))
    elif damage == "wrong_shape":
        _rewrite_metadata(path, lambda d, t: t.update({"1.v_basis": torch.zeros(3, 32).double()}))
    elif damage == "field_gone":
        _rewrite_metadata(path, lambda d, t: d["layers"][0].pop("k_rank"))
    elif damage == "widths_short":
        _rewrite_metadata(path, lambda d, t: d["layers"][0].update(
            k_code={"bit_runs": [[1, 4]], "group": 64}))
    error = FileNotFoundError if damage == "missing" else PlanFileError
    with pytest.raises(error, match=message) as info:
        lorc_fx.compress(model, plan=path, blocks=blocks)
    assert str(path) in str(info.value)
    assert model._lorc_plan is report.plan  # the installed plan stays


def test_save_pretrained_of_a_compressed_model_warns_once(tmp_path, caplog):
    model = tiny()
    lorc_fx.compress(model, 0.75, **FAST)
    with caplog.at_level(logging.WARNING, logger="lorc_fx"):
        model.save_pretrained(tmp_path / "a")
        model.save_pretrained(tmp_path / "b")
    warnings = [r.getMessage() for r in caplog.records if "save_pretrained" in r.getMessage()]
    assert len(warnings) == 1 and "lorc_fx.save_plan(model, PATH)" in warnings[0]
    assert (tmp_path / "b" / "config.json").is_file()  # still saved, plainly
    caplog.clear()
    tiny().save_pretrained(tmp_path / "c")  # an uncompressed model says nothing
    assert not caplog.records


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny_llama(root / "model"), write_text(root / "text.txt")


def test_data_aware_plan_round_trips_with_its_oblique_key_basis(tiny_with_tokenizer, tmp_path,
                                                                monkeypatch, forbid_planning):
    from lorc_fx.data.models import load_model
    from lorc_fx.plan.calibration import CalibrationOptions

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    directory, text = tiny_with_tokenizer
    model = load_model(directory)
    report = lorc_fx.compress(model, 0.75, basis="attention", schedule="greedy",
                              rope="reconstruct", latent_bits=16,
                              calibration=CalibrationOptions(texts=(text,), tokens=512, window=64))
    assert not torch.equal(report.plan.layers[0].k_rebuild, report.plan.layers[0].k_basis)
    path = report.save(tmp_path / "plan.safetensors")

    forbid_planning()
    again = load_model(directory)
    assert_same_plan(lorc_fx.compress(again, plan=path).plan, report.plan)
    assert torch.equal(latent_logits(again), latent_logits(model))


def test_cli_plan_save_then_eval_plan(tiny_with_tokenizer, tmp_path, capsys, forbid_planning):
    from lorc_fx.cli import main

    directory, text = tiny_with_tokenizer
    path = tmp_path / "plan.safetensors"
    assert main(["plan", "--model", directory, "--cache-fraction", "0.75", "--schedule",
                 "uniform", "--save", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    forbid_planning()
    out = tmp_path / "eval.json"
    common = ["eval", "--model", directory, "--plan", str(path), "--text", text,
              "--tokens", "128", "--window", "64", "--prompts", "1", "--new-tokens", "2"]
    assert main([*common, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["plan"]["fingerprint"] == lorc_fx.load_plan(path).fingerprint
    assert data["plan"]["options"]["schedule"] == "uniform"
    assert main([*common, "--cache-fraction", "0.5"]) == 2
    assert "--plan installs a saved plan as it is" in capsys.readouterr().err


def test_a_bit_budget_plan_and_its_measured_candidates_survive_the_file(tmp_path, monkeypatch):
    """The plan the bit-width search kept (its kind, latent bits and group, the candidates it
    measured) is installed again as it was: the same bytes, the same logits."""
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny()
    report = lorc_fx.compress(model, bits_per_value=7.0, rope="commute", progress=False, **FAST)
    assert report.plan.candidates
    expected = latent_logits(model)
    path = report.save(tmp_path / "bits.safetensors")
    fresh = tiny()
    lorc_fx.compress(fresh, plan=path)
    assert_same_plan(fresh._lorc_plan, report.plan)
    assert torch.equal(latent_logits(fresh), expected)
