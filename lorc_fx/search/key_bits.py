"""The keys_waterfilled candidate: key rows' rounding errors measured on calibration latents,
then ``plan.bit_allocation`` spends the budget over them.

A row's relative rounding error at a width depends on how its values spread within a group
of tokens (outlier tokens widen the range every code shares), which no weight spectrum says;
so the calibration windows run through the latent cache of the full-rank plan once, and each
layer's cached key latent is quantized at every width of ``KEY_WIDTHS`` to measure it.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache.latent_cache import scale_dtype
from lorc_fx.cache.quantize import QuantSpec, fake_quantize
from lorc_fx.plan.bit_allocation import KEY_GROUP, KEY_WIDTHS, keys_waterfilled_plan
from lorc_fx.plan.calibration import calibration_tokenizer, calibration_windows
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import LayerInput, Plan, key_energies, plan_layers
from lorc_fx.search.windows import through_cache

ERROR_TOKENS = 4096  # calibration tokens the rounding errors are measured on


@torch.no_grad()
def rounding_errors(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                    windows: torch.Tensor, widths: tuple[int, ...] = KEY_WIDTHS,
                    group: int = KEY_GROUP) -> list[dict[int, torch.Tensor]]:
    """Per layer of ``full`` (a full-rank, unquantized plan), per width of ``widths``, each
    key latent row's squared rounding error over its squared values (per channel, groups of
    ``group`` tokens) on ``windows``; an empty dict for a layer without key latents."""
    scales = scale_dtype(full) or next(model.parameters()).dtype
    power: dict[int, torch.Tensor] = {}
    error: dict[tuple[int, int], torch.Tensor] = {}
    for _, _, cache in through_cache(model, blocks, full, windows):
        for l in full.layers:
            if l.skipped or not l.k_compressible:
                continue
            latent = cache.layers[l.layer].keys  # (b, 1, n, r): unquantized at full rank
            z = latent.double()
            power[l.layer] = power.get(l.layer, 0) + (z ** 2).sum((0, 1, 2))
            for bits in widths:
                spec = QuantSpec.per_channel(bits, group, scales)
                err = fake_quantize(latent, spec)[0].double() - z
                error[l.layer, bits] = error.get((l.layer, bits), 0) + (err ** 2).sum((0, 1, 2))
    return [{bits: (error[l.layer, bits] / power[l.layer].clamp_min(1e-30)).cpu()
             for bits in widths} if l.layer in power else {} for l in full.layers]


def keys_waterfilled_candidate(model: nn.Module, blocks: list[AttentionBlock],
                               options: PlanOptions, inputs: list[LayerInput], note: str) -> Plan:
    """The keys_waterfilled plan at ``options``' budget (``options.rope`` resolved to
    ``reconstruct``, its basis to the one ``inputs`` carry; values at ``latent_bits`` per token
    in groups of ``latent_group``)."""
    full = plan_layers(inputs, replace(options, cache_fraction=1.0, bits_per_value=None,
                                       latent_bits=16, key_fraction=None))
    calibration = options.calibration
    windows = calibration_windows(calibration_tokenizer(model, calibration), calibration, model)
    windows = windows[:max(1, ERROR_TOKENS // windows.shape[1])]
    rho = rounding_errors(model, blocks, full, windows)
    plan = keys_waterfilled_plan(full, key_energies(inputs, options), rho, options)
    plan.basis_note = note
    return plan
