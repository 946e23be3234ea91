"""Choose the calibrated schedule's key/value split by measuring the loss it causes.

The error models rank rows within keys and within values well, but their exchange rate
between keys and values is off by a factor that depends on how hard the cache is compressed
(the softmax saturates, errors compound over layers). So the split is measured: the model's
loss on held-out calibration windows, through the real latent cache, for key fractions on the
rank grid, minimised by golden-section search (the loss is unimodal in the split: too few key
dims or too few value dims both hurt). The choice is cached on disk next to the calibration.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.plan.allocation import feasible_key_fractions
from lorc_fx.plan.calibration import (calibration_file, calibration_tokenizer,
                                      calibration_windows, model_fingerprint, sampling_key,
                                      save_atomic, write_json)
from lorc_fx.plan.options import DEFAULT_FRACTION, CalibrationOptions, PlanOptions
from lorc_fx.plan.planner import LayerInput, Plan, plan_layers, process_plan
from lorc_fx.search.windows import through_cache

_FORMAT = 4  # bump when the bases change: cached splits were measured with the old ones
SEARCH_TOKENS = 2048  # 4 windows of 512: the losses of neighbouring splits differ by ~0.01 nat


def calibration_loss(model: nn.Module, blocks: list[AttentionBlock], plan: Plan | None,
                     windows: torch.Tensor) -> float:
    """Mean next-token loss over ``windows``; with a ``plan`` (of ``blocks``, whose attention
    hands pre-RoPE latents their angles), through its latent cache."""
    total, count = 0.0, 0
    plan = None if plan is None else process_plan(plan, blocks)
    for batch, output, _ in through_cache(model, blocks, plan, windows):
        logits = output.logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))
        count += batch[:, 1:].numel()
    return total / count


def _grid(inputs: list[LayerInput], options: PlanOptions) -> list[float]:
    """Key fractions on the rank grid for which values can make up the rest (layers the
    plan skips stay full)."""
    plan = plan_layers(inputs, options)
    layers = plan.layers
    lo, hi = feasible_key_fractions(
        [l.k_full for l in layers], [l.v_full for l in layers],
        [l.k_compressible and not l.skipped for l in layers],
        [l.v_compressible and not l.skipped for l in layers], plan.latent_budget,
        [0 if options.allow_zero_rank else min(options.rank_multiple, l.v_full) for l in layers])
    step = options.rank_multiple / max(l.k_full for l in layers)
    return [i * step for i in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def _cache_file(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions):
    asked = asdict(replace(options, key_fraction=None))
    # the key as the options of plan file version 5 spelled it (cached splits stay valid):
    # no target, and the default fraction beside a budget in bits
    del asked["max_ppl_increase"]
    asked["cache_fraction"] = options.cache_fraction or DEFAULT_FRACTION
    if not options.budget.in_bits and options.latent_bits == 16:
        del asked["bits_per_value"]  # a plan as before budgets in bytes existed: same key
    else:
        asked["budget"] = "bytes"  # quantized latents' cache_fraction counted elements before
    return calibration_file("split-", {"format": _FORMAT, "model": model_fingerprint(model),
                                       "k_weights": [b.k.weight for b in blocks if b.supported],
                                       "options": asked, **sampling_key(options.calibration)},
                            ".json")


def held_out_calibration(options: PlanOptions) -> CalibrationOptions:
    """The calibration options of the held-out windows: another seed, ``SEARCH_TOKENS``."""
    return replace(options.calibration, tokens=min(SEARCH_TOKENS, options.calibration.tokens),
                   seed=options.calibration.seed + 1)


def held_out_windows(model: nn.Module, options: PlanOptions, tokenizer=None) -> torch.Tensor:
    """Calibration windows the bases were not measured on (another seed)."""
    held_out = held_out_calibration(options)
    return calibration_windows(tokenizer or calibration_tokenizer(model, held_out), held_out,
                               model)


def held_out_loss(model: nn.Module, blocks: list[AttentionBlock], plan: Plan) -> float:
    """The model's loss through a latent cache of ``plan`` on held-out calibration windows."""
    return calibration_loss(model, blocks, plan, held_out_windows(model, plan.options))


def _golden_steps(n: int) -> int:
    """About how many of ``n`` grid points :func:`measured_split` measures (a progress total):
    each step keeps ~1/1.618 of the interval and measures one new point."""
    return 2 + max(0, math.ceil(math.log(max(n, 1) / 3) / math.log(1.618))) + 3


def measured_split(model: nn.Module, blocks: list[AttentionBlock], inputs: list[LayerInput],
                   options: PlanOptions, tokenizer=None) -> tuple[float, float]:
    """The key fraction on the rank grid with the least held-out loss, and that loss."""
    path = _cache_file(model, blocks, options)
    if path.is_file():
        cached = json.loads(path.read_text())
        return cached["key_fraction"], cached["loss"]
    grid = _grid(inputs, options)
    if not grid:  # the fraction is out of reach: let the plan say so
        return options.cache_fraction or DEFAULT_FRACTION, math.inf
    windows = held_out_windows(model, options, tokenizer)
    losses: dict[int, float] = {}

    def loss(i: int) -> float:
        if i not in losses:
            plan = plan_layers(inputs, replace(options, key_fraction=grid[i]))
            losses[i] = calibration_loss(model, blocks, plan, windows)
            bar.update()
        return losses[i]

    from tqdm.auto import tqdm

    bar = tqdm(total=_golden_steps(len(grid)), unit="plan", mininterval=1.0,
               desc=f"key/value split ({options.rope})")
    lo, hi = 0, len(grid) - 1
    while hi - lo > 2:  # golden-section search on the integer grid
        a = hi - round((hi - lo) / 1.618)
        b = lo + round((hi - lo) / 1.618)
        if a == b:
            b = a + 1
        if loss(a) <= loss(b):
            hi = b
        else:
            lo = a
    best = min(range(lo, hi + 1), key=loss)
    bar.total = bar.n  # the estimate may be off by one
    bar.close()
    save_atomic({"key_fraction": grid[best], "loss": losses[best],
                 "losses": {f"{grid[i]:.4f}": v for i, v in sorted(losses.items())}},
                path, write_json)
    return grid[best], losses[best]
