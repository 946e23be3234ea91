"""Basis providers: what picks a layer's K/V basis and ranks its rows.

A provider returns, per layer index, a :class:`LayerMetric`: an input metric ``G``
(``E[x xᵀ]`` of the projection input, under some assumption; the plan takes the spectrum of
``W·S`` with ``S Sᵀ = G``), or precomputed spectra. No entry: the identity, i.e. the paper's
weight-only SVD.

- ``auto`` (default): ``attention``, or ``whitened`` where attention cannot be probed
  (:func:`resolve`); both calibrate on text sampled from the model itself unless told
  otherwise, so they need no corpus and no tokenizer. Only a model with neither BOS nor EOS
  token falls back to ``weight``, and the plan says so (``Plan.basis_note``);
- ``weight``: the paper, inputs assumed isotropic;
- ``norm``: no calibration; ``G = diag(γ²) + ββᵀ`` from the normalisation feeding K/V;
- ``whitened``: ``G`` measured on calibration text;
- ``attention``: data-aware on both sides: rows ranked by the first-order change of the
  layer's attention output (``lorc_fx.metrics``), measured on calibration text.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock, named_params
from .spectra import Spectrum

if TYPE_CHECKING:
    from .options import PlanOptions

log = logging.getLogger(__name__)


@dataclass
class LayerMetric:
    input_gram: torch.Tensor | None = None
    k_spectrum: Spectrum | None = None
    v_spectrum: Spectrum | None = None
    # the key spectrum is of the keys attention reads (after any norm and RoPE): the keys
    # the cache receives, so it holds where the K projection is not linear up to the cache
    k_of_cached_keys: bool = False


BasisProvider = Callable[[nn.Module, list[AttentionBlock], "PlanOptions"], dict[int, LayerMetric]]


def weight_only(model, blocks, options) -> dict[int, LayerMetric]:
    """The paper: SVD of the weight itself (inputs assumed isotropic)."""
    return {}


def norm_scaled(model, blocks, options) -> dict[int, LayerMetric]:
    from .norm_metric import norm_grams

    return {layer: LayerMetric(input_gram=g) for layer, g in norm_grams(model, blocks).items()}


def whitened(model, blocks, options) -> dict[int, LayerMetric]:
    from .calibration import layer_statistics

    stats = layer_statistics(model, blocks, options.calibration)
    return {layer: LayerMetric(input_gram=s.input_gram) for layer, s in stats.items()}


class AttentionNotProbed(ValueError):
    """The attention probe saw no attention weights of a block: its module does not call
    transformers' AttentionInterface (its own eager code, or a shared module)."""


def attention_aware(model, blocks, options) -> dict[int, LayerMetric]:
    """Keys: the score metric (keys ⊗ queries): a RoPE-commuting basis of post-RoPE keys,
    or, where the latent is taken before RoPE (``rope='reconstruct'``), the oblique basis of
    the rotation-averaged query metric (the RoPE-commuting one under ``objective="speed"``:
    it holds for keys on either side of RoPE, and decode then scores them per rotary pair);
    values: attention-averaged values, with the per-token value moment ``W_v G W_vᵀ`` beside
    them."""
    from .calibration import layer_statistics
    from .metrics import (attention_key_spectrum, attention_pre_rope_key_spectrum,
                          attention_value_spectrum)

    stats = layer_statistics(model, blocks, options.calibration)
    params = named_params(model)
    out = {}
    for block in blocks:
        if not block.supported:
            continue
        s = stats[block.layer]
        if s.attention is None:
            raise AttentionNotProbed(
                f"{type(model).__name__} does not route attention through transformers' "
                "AttentionInterface, so the 'attention' basis cannot measure it; use "
                "basis='whitened'")
        shape = (block.num_kv_heads, block.head_dim, block.rope_k)
        # keys behind a norm: only the keys attention reads are known, so their latent is
        # taken after RoPE even in a reconstruct plan (docs/design.md, "Keys: three cases")
        behind_norm = block.k_path == "norm"
        pre_rope = (block.rope_k.style != "none" and options.rope == "reconstruct"
                    and not behind_norm)
        if pre_rope and not options.rope_commuting_keys:
            w_k = block.k.weight_tensor(params).detach().cpu()
            keys = attention_pre_rope_key_spectrum(s.attention, w_k, s.input_gram, *shape)
        else:
            keys = attention_key_spectrum(s.attention, *shape)
        w_v = block.v.weight_tensor(params).detach().cpu().to(torch.float64)
        out[block.layer] = LayerMetric(
            input_gram=s.input_gram, k_spectrum=keys,
            v_spectrum=attention_value_spectrum(s.attention, block.head_dim,
                                                w_v @ s.input_gram @ w_v.T),
            k_of_cached_keys=not pre_rope)
    return out


WEIGHT_NOTE = ("weight-only SVD (the paper's calibration-free basis), {why}; on the default "
               "model it costs far more quality than basis='auto' (bench/quality.md)")


def resolve(name: str, model, blocks, options) -> tuple[str, dict[int, LayerMetric], str]:
    """(basis used, its metrics, a note for the report where the basis is the weight-only
    one). ``auto`` is ``attention`` where the model routes attention through transformers'
    AttentionInterface (every block's, measured), else ``whitened``; either calibrates (by
    default on text sampled from the model, ``options.calibration``) and falls back to
    ``weight`` (logged, and noted) only where no calibration is possible at all, e.g. the
    model names no BOS, EOS, CLS or padding token to sample from."""
    if name != "auto":
        note = WEIGHT_NOTE.format(why="as asked (basis='weight')") if name == "weight" else ""
        return name, BASES[name](model, blocks, options), note
    from .attention_probe import probe_supported
    from .calibration import CalibrationUnavailable

    chosen = "attention" if probe_supported(model) else "whitened"
    try:
        try:
            return chosen, BASES[chosen](model, blocks, options), ""
        except AttentionNotProbed as err:
            log.info("basis 'auto' is 'whitened': %s", err)
            return "whitened", whitened(model, blocks, options), ""
    except CalibrationUnavailable as err:
        log.warning("basis 'auto' falls back to 'weight' (weight-only SVD, no calibration): %s",
                    err)
        return "weight", {}, WEIGHT_NOTE.format(why=f"because no calibration was possible: {err}")


BASES: dict[str, BasisProvider] = {
    "auto": weight_only,  # resolved by resolve(); weight-only where a model is not at hand
    "weight": weight_only,
    "norm": norm_scaled,
    "whitened": whitened,
    "attention": attention_aware,
}
