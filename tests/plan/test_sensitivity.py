"""The loss's sensitivity to each cached latent channel (``plan.sensitivity``) on a tiny
random llama: against autograd through the latent itself, and the latents the cache holds."""
from dataclasses import replace

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from lorc_fx.analysis import analyze
from lorc_fx.api import compress
from lorc_fx.plan.calibration import owner_module
from lorc_fx.plan.sensitivity import ProjectionRecorder, sensitivities_and_latents
from lorc_fx.search.codebooks import calibration_latents, coded_sides
from helpers.families import VOCAB, build, config_for


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama", heads=4, kv_heads=2, layers=2))


@pytest.fixture(scope="module")
def windows():
    return torch.randint(3, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))


def oblique(plan, seed=0):
    """``plan`` with every basis mixed by an invertible ``A`` (``P → A·P``, ``B → A⁻ᵀ·B``):
    the same keys and values from other latents, so the gradient must be carried by ``B``."""
    gen = torch.Generator().manual_seed(seed)

    def mix(basis, rebuild):
        a = torch.eye(len(basis), dtype=basis.dtype) + 0.3 * torch.randn(
            len(basis), len(basis), generator=gen, dtype=basis.dtype) / len(basis) ** 0.5
        return a @ basis, torch.linalg.inv(a).T @ rebuild

    layers = []
    for l in plan.layers:
        (kp, kb), (vp, vb) = mix(l.k_basis, l.k_rebuild), mix(l.v_basis, l.v_rebuild)
        layers.append(replace(l, k_basis=kp, k_rebuild=kb, v_basis=vp, v_rebuild=vb))
    return replace(plan, layers=layers)


def autograd_fisher(model, blocks, plan, windows):
    """E[(∂L/∂z_c)²] over ``windows`` (first tokens left out), by autograd through the latent:
    each projection's output replaced by ``Bᵀ·z`` of its own ``z = P·output``, ``z`` kept in
    the graph (the weights need their gradients: the whole graph is built)."""
    layer = {l.layer: l for l in plan.layers}
    latents, handles = {}, []
    for b in blocks:
        for side in ("k", "v"):
            basis = getattr(layer[b.layer], f"{side}_basis").float()
            rebuild = getattr(layer[b.layer], f"{side}_rebuild").float()

            def hook(module, args, out, key=(b.layer, side), basis=basis, rebuild=rebuild):
                latents[key] = out @ basis.T
                latents[key].retain_grad()
                return latents[key] @ rebuild
            module = model.get_submodule(owner_module(getattr(b, side).weight))
            handles.append(module.register_forward_hook(hook))
    sums, tokens = {}, 0
    try:
        for batch in windows.split(2):
            logits = model(batch, use_cache=False).logits[:, :-1]
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              batch[:, 1:].reshape(-1), reduction="sum").backward()
            for key, z in latents.items():
                sums[key] = sums.get(key, 0) + (z.grad[:, 1:].double() ** 2).sum((0, 1))
            tokens += batch[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return {key: s / tokens for key, s in sums.items()}


def test_sensitivities_are_fisher_times_the_cached_latents_power(model, windows):
    blocks = analyze(model)
    plan = oblique(compress(model, 1.0, schedule="uniform", basis="weight",
                            rope="reconstruct").plan)
    sides = coded_sides(plan)
    got, _ = sensitivities_and_latents(model, blocks, plan, sides, windows,
                                       keep_latents=False)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # as it was
    fisher = autograd_fisher(model, blocks, plan, windows)
    cached = calibration_latents(model, blocks, plan, windows)  # keys before RoPE, sinks out
    assert set(got) == set(sides) == set(cached)
    for side in sides:
        power = (cached[side].double() ** 2).mean(0)
        torch.testing.assert_close(got[side], fisher[side] * power, rtol=1e-3, atol=1e-12)
        assert (got[side] > 0).all()


def test_the_sensitivities_pass_gives_the_latents_the_cache_holds(model, windows):
    """What the books are fitted on in a first plan: the latents of the sensitivities' own
    forward, the ones a forward through the full-rank cache stores (keys before RoPE)."""
    blocks = analyze(model)
    plan = oblique(compress(model, 1.0, schedule="uniform", basis="weight",
                            rope="reconstruct").plan)
    sides = coded_sides(plan)
    weights, latents = sensitivities_and_latents(model, blocks, plan, sides, windows)
    cached = calibration_latents(model, blocks, plan, windows)
    assert set(latents) == set(cached) == set(sides)
    for side in sides:
        assert latents[side].dtype == torch.float32
        torch.testing.assert_close(latents[side], cached[side], rtol=1e-4, atol=1e-5)
    again, none = sensitivities_and_latents(model, blocks, plan, sides, windows,
                                            keep_latents=False)
    assert all(torch.equal(weights[s], again[s]) for s in sides) and none == {}


def test_keys_cached_after_rope_have_no_sensitivity(model, windows):
    """Commuted keys are cached after RoPE: not a linear image of the projection's rows."""
    blocks = analyze(model)
    plan = compress(model, 1.0, schedule="uniform", basis="weight", rope="commute").plan
    assert sensitivities_and_latents(model, blocks, plan, coded_sides(plan), windows) is None
    values = [s for s in coded_sides(plan) if s[1] == "v"]
    weights, _ = sensitivities_and_latents(model, blocks, plan, values, windows,
                                           keep_latents=False)
    assert set(weights) == set(values)


def test_a_first_calibration_measures_the_sensitivities_in_its_own_pass(model, tmp_path,
                                                                         monkeypatch):
    """``calibration_with_gradients``: where the statistics are not on disk, one pass
    writes them as ``layer_statistics`` computes them and returns the projections' moments,
    from which any full-rank basis gets the sensitivities and latents a pass of their own
    measures; with the statistics on disk it measures nothing."""
    from lorc_fx.plan import calibration
    from lorc_fx.plan.options import CalibrationOptions
    from lorc_fx.plan.sensitivity import calibration_with_gradients, sensitivities

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path))
    blocks = analyze(model)
    options = CalibrationOptions(tokens=96, window=24)
    moments = calibration_with_gradients(model, blocks, options)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # as it was
    windows = calibration.calibration_windows(None, options, model)
    plain = calibration.collect(model, blocks, windows)
    written = torch.load(calibration.cache_path(model, blocks, options), weights_only=True)
    for name, gram in plain["input_grams"].items():
        torch.testing.assert_close(written["input_grams"][name], gram)
    for layer, moment in plain["attention"].items():
        for key, value in moment.items():
            torch.testing.assert_close(torch.as_tensor(written["attention"][layer][key]),
                                       torch.as_tensor(value))
    assert calibration_with_gradients(model, blocks, options) is None

    plan = oblique(compress(model, 1.0, schedule="uniform", basis="weight",
                            rope="reconstruct").plan)
    sides = coded_sides(plan)
    got_weights, got_latents = sensitivities(moments, blocks, plan, sides)
    weights, latents = sensitivities_and_latents(model, blocks, plan, sides, windows)
    for side in sides:  # the calibration's attention and SDPA round float32 apart
        torch.testing.assert_close(got_weights[side], weights[side], rtol=1e-5, atol=0)
        torch.testing.assert_close(got_latents[side], latents[side])


def test_recomputed_layers_give_the_same_gradients_and_are_restored(model, windows):
    """``recompute_layers``: each decoder layer runs again in the backward (its projections
    twice a batch), the recompute adds the forward's own leaf, and the gradients are the
    ones a kept graph gives; on leaving, the layers run as their class says."""
    blocks = analyze(model)
    sides = [(b.layer, s) for b in blocks for s in ("k", "v")]
    k_proj = model.get_submodule(owner_module(blocks[0].k.weight))
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers
    moments, calls = {}, []
    handle = k_proj.register_forward_hook(lambda *_: calls.append(1))
    try:
        for recompute in (False, True):
            with ProjectionRecorder(model, blocks, sides, recompute_layers=recompute) as rec:
                assert all(("forward" in l.__dict__) == recompute for l in layers)
                calls.clear()
                with torch.enable_grad():
                    rec.backward(windows[:2], model(windows[:2], use_cache=False).logits)
                assert len(calls) == (2 if recompute else 1)
            moments[recompute] = rec.moments()
    finally:
        handle.remove()
    assert not any("forward" in l.__dict__ for l in layers)
    for side in sides:
        torch.testing.assert_close(moments[True].gradients[side], moments[False].gradients[side])
        assert float(moments[True].gradients[side].abs().sum()) > 0
        torch.testing.assert_close(moments[True].grams[side], moments[False].grams[side])
