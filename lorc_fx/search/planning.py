"""The plan search: from a model and the options asked to the plan with the least held-out
loss among every storage scheme's candidates (or, with ``max_ppl_increase``, the smallest
fraction that meets the target).

What is resolved before any candidate: the shards (the model's tensor-parallel split), the
basis over shards, the calibration text this machine can read, the choices tried (RoPE
modes, bit widths, group sizes) and whether candidates are measured at all. A first plan of
a model says once what it will measure and samples every calibration it needs in one pass.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import replace
from pathlib import Path

from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.analysis.sharding import model_split
from lorc_fx.data.models import user_cache_dir
from lorc_fx.plan.calibration import (CalibrationUnavailable, cache_path, calibration_tokenizer,
                                      can_read, sample_self_text, sampled_before,
                                      self_text_request, usable_calibration)
from lorc_fx.plan.options import AUTO, SELF_TEXT, CalibrationOptions, PlanOptions
from lorc_fx.plan.planner import Plan
from lorc_fx.plan.schedules import UnreachableFraction

from .candidates import NEGLIGIBLE_LOSS, best_candidate, candidates, plain_fits
from .context import (SearchContext, bit_choices, calibrated_basis, group_choices,
                      rope_modes)
from .fraction import bisection_steps, smallest_fraction
from .split import calibration_loss, held_out_calibration, held_out_loss, held_out_windows

log = logging.getLogger(__name__)


def plan_model(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
               progress: bool = True) -> Plan:
    """The plan of ``model`` (its attention ``blocks``) for ``options``: the candidate with
    the least held-out calibration loss, or the first that plans where nothing is measured
    (``lorc_fx.plan`` documents the choices)."""
    search = search_context(model, blocks, options)
    first, start = None, time.perf_counter()
    if search.calibrates or search.searched:
        # plain quantization at its widest fits: its candidates, measured first, may end
        # the search before any calibration
        plain_first = search.searched and plain_fits(search, _coded_widths(search)[-1])
        first = _announce_first_plan(search, plain_first)
        options = search.options
        wanted = ([] if plain_first else [options.calibration]) + (
            [held_out_calibration(options)]
            if search.measure or (options.schedule == "calibrated" and options.key_fraction is None)
            else [])
        _sample_ahead(model, blocks, options, wanted)
    if search.options.max_ppl_increase is None:
        best, _ = best_plan(search, progress)
    else:
        best = _plan_within(search, search.options.max_ppl_increase)
    if first is not None:
        log.warning("lorc_fx: first plan made in %.0f s; later plans of this model reuse what %s "
                    "keeps", time.perf_counter() - start, first)
    return best


def search_context(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions
                   ) -> SearchContext:
    """What the search of ``options`` tries on ``model``: the shards (the model's
    tensor-parallel split) and the basis over them resolved, the calibration text this
    machine can read, the RoPE modes, bit widths and group sizes, and whether candidates are
    measured at all."""
    shards = _shards(blocks, options.shards)
    basis = options.basis
    if shards > 1 and basis == "auto":
        log.warning("basis 'auto' over %d shards of the KV heads: low-rank candidates use "
                    "'whitened' (the attention-aware basis has no per-shard form yet)", shards)
        basis = "whitened"
    options = replace(options, shards=shards, basis=basis)
    calibrates = calibrated_basis(basis) or options.max_ppl_increase is not None
    if calibrates or options.budget.in_bits:
        options = replace(options, calibration=usable_calibration(model, options.calibration))
    widths = bit_choices(options.latent_bits, searchable=not options.budget.whole and (
        calibrates or options.budget.in_bits) and can_read(model, options.calibration))
    groups = group_choices(options.latent_group, widths)
    modes = (["commute"] if shards > 1 and options.rope == AUTO
             else rope_modes(options.rope, model, blocks, options.objective))
    measure = len(modes) > 1 or len(widths) > 1 or options.max_ppl_increase is not None
    return SearchContext(model, blocks, options, modes, widths, groups, measure, calibrates)


def best_plan(search: SearchContext, progress: bool = False, full_loss: float | None = None
              ) -> tuple[Plan, float | None]:
    """The plan of the candidate with the least held-out calibration loss (measured where
    ``search.measure`` asks, else the first candidate that plans), and that loss. Where the
    storage is searched, a candidate within ``NEGLIGIBLE_LOSS`` of the uncompressed model's
    held-out loss (``full_loss``, measured here where not given and a later candidate is to
    be built) ends the search, before any calibration a later candidate needs."""
    @functools.cache
    def enough() -> float:
        full = full_loss if full_loss is not None else calibration_loss(
            search.model, search.blocks, None, held_out_windows(search.model, search.options))
        return full + NEGLIGIBLE_LOSS

    return best_candidate(candidates(search), progress,
                          enough if search.measure and search.searched else None,
                          search.options.budget, search.scheme_losses)


def _plan_within(search: SearchContext, max_ppl_increase: float) -> Plan:
    """The plan at the smallest fraction meeting ``max_ppl_increase``, with its search."""
    model, blocks = search.model, search.blocks
    full_loss = calibration_loss(model, blocks, None, held_out_windows(model, search.options))
    plans: dict[float, Plan] = {}

    def loss_at(fraction: float) -> float:
        try:
            plans[fraction], loss = best_plan(search.at_budget(fraction, True),
                                              full_loss=full_loss)
        except UnreachableFraction:
            return math.inf
        return held_out_loss(model, blocks, plans[fraction]) if loss is None else loss

    log.warning("lorc_fx: finding the smallest cache fraction within +%.3g%% perplexity on "
                "held-out calibration text (one plan per fraction tried)", 100 * max_ppl_increase)
    with tqdm(total=bisection_steps(), desc="cache fraction search", unit="plan") as bar:
        found = smallest_fraction(loss_at, full_loss, max_ppl_increase, bar.update)
        bar.total = bar.n  # bisection may stop early
    chosen = plans.get(found.chosen)
    if chosen is None:  # 1.0: every smaller fraction tried missed the target
        chosen, _ = best_plan(search.at_budget(found.chosen, False))
    log.info("lorc_fx: cache fraction %.2f chosen for max_ppl_increase=%g (held-out ×%.4f)",
             found.chosen, max_ppl_increase, found.ratios.get(found.chosen, 1.0))
    return replace(chosen, fraction_search=found.to_json())


def _shards(blocks: list[AttentionBlock], asked: int | None) -> int:
    """The plan's shards: the tensor-parallel split of the blocks where there is one (a
    different ``asked`` is refused), else ``asked`` (default 1)."""
    split = model_split(blocks)
    if split is None:
        return 1 if asked is None else asked
    if asked is not None and asked != split.count:
        raise ValueError(f"shards={asked}, but the model is split over {split.count} "
                         "tensor-parallel processes; leave shards unset or give that split")
    return split.count


def _coded_widths(search: SearchContext) -> list[int]:
    """The searched widths below 16, narrowest first."""
    return sorted(w for w in search.widths if w != 16)


def _announce_first_plan(search: SearchContext, plain_first: bool) -> Path | None:
    """Where a first plan of the model with these calibration options keeps what it
    measures, after one warning saying what it does; ``None`` where the model was sampled
    (or calibrated) before."""
    model, options = search.model, search.options
    if cache_path(model, search.blocks, options.calibration).is_file() or (
            sampled_before(model, held_out_calibration(options)) and search.measure):
        return None
    where = user_cache_dir() / "calibration"
    low_rank = ("attention statistics and the key/value split of "
                f"{' and '.join(search.modes)} RoPE mode(s) for low-rank candidates")
    # where not even the narrowest plain quantization fits, vector codes plan
    # (``schemes.vector``) and no low-rank candidate is measured
    if search.searched and "reconstruct" in search.modes \
            and not plain_fits(search, _coded_widths(search)[0]):
        low_rank = ("attention statistics of reconstruct RoPE mode, then codebooks of vector "
                    "codes for every layer's keys and values and the loss's sensitivity to "
                    "each of their latent channels, then which layers retrieval leans on "
                    "(multikey prompts, one layer coded at a time)")
    steps = ["sampling text from the model"] if SELF_TEXT in options.calibration.texts else []
    if plain_first:
        steps.append("measuring plain 8- and 4-bit KV quantization on held-out windows of it, "
                     f"then, unless one is within noise of the full cache, {low_rank}")
    else:
        steps += ["measuring candidate plans on held-out windows of it"] if search.measure else []
        steps.append(low_rank)
    log.warning("lorc_fx: first plan of %s: %s (up to minutes on a CPU; progress below), kept "
                "in %s for later plans. A saved plan skips it all: report.save(path), then "
                "compress(model, plan=path)", type(model).__name__, ", ".join(steps), where)
    return where


def _sample_ahead(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                  wanted: list[CalibrationOptions]) -> None:
    """Before a first calibration on text sampled from the model, sample the sequences of
    every ``wanted`` calibration in one pass: side by side they cost little more than the
    largest alone."""
    if cache_path(model, blocks, options.calibration).is_file():
        return  # calibrated before: whatever is still needed is sampled where it is read
    requests = [r for r in map(self_text_request, wanted) if r is not None]
    if requests:
        try:
            sample_self_text(model, calibration_tokenizer(model, options.calibration), requests)
        except CalibrationUnavailable:
            pass  # resolve() falls back and says why
