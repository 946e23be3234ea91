"""The user's entry points: ``analyze`` a model's attention, ``plan`` its ranks, ``compress`` it,
``save_plan`` / ``load_plan`` to compress it again later without planning.

Orchestration only: each stage's work lives in its package (``analysis`` → ``plan`` →
``cache``); what is measured through the real latent cache (the key/value split, the RoPE
mode) in ``search``."""
from __future__ import annotations

import inspect
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from lorc_fx.analysis import analyze
from lorc_fx.analysis.capture import NoTokenInputs
from lorc_fx.analysis.records import AttentionBlock, attention_module, named_params
from lorc_fx.analysis.sharding import model_split
from lorc_fx.cache import install, layers_kept_as_built
from lorc_fx.plan import plan_file
from lorc_fx.plan.bases import resolve
from lorc_fx.plan.calibration import (CalibrationUnavailable, cache_path, calibration_tokenizer,
                                      can_read, sample_self_text, sampled_before,
                                      self_text_request, usable_calibration)
from lorc_fx.data.models import user_cache_dir
from lorc_fx.plan.options import (LATENT_BITS, LATENT_GROUPS, ROPE_MODES, SELF_TEXT,
                                  CalibrationOptions, PlanOptions)
from lorc_fx.plan.planner import (LayerInput, Plan, layer_inputs, plain_quantized_plan,
                                  plan_layers)
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.report import CompressionReport
from lorc_fx.search.bits import (NEGLIGIBLE_LOSS, Candidate, best_candidate, candidates,
                                 over_budget)
from lorc_fx.search.key_bits import keys_waterfilled_candidate
from lorc_fx.search.vector_bits import vector_candidate
from lorc_fx.search.fraction import bisection_steps, check_target, smallest_fraction
from lorc_fx.search.split import (calibration_loss, held_out_calibration, held_out_loss,
                                  held_out_windows, measured_split)

log = logging.getLogger(__name__)

# bases measured on calibration text; with them the calibrated schedule measures its split too
CALIBRATED_BASES = frozenset({"whitened", "attention"})


def rope_modes(rope: str, model: nn.Module, blocks: list[AttentionBlock],
               objective: str = "quality") -> list[str]:
    """The RoPE modes to plan: ``auto`` tries ``commute`` and, for ``objective="quality"``
    where every rotary attention module takes the step's angles as ``position_embeddings``
    (the latent cache needs them to rotate rebuilt keys), ``reconstruct``; for
    ``objective="speed"`` only ``commute``, whose keys absorbed attention reads without
    rebuilding them. An explicit ``reconstruct`` on a model whose attention does not take
    the angles is refused."""
    rotary = [b for b in blocks if b.supported and b.rope_k.style != "none"]
    hands_angles = all(
        "position_embeddings" in inspect.signature(attention_module(model, b).forward).parameters
        for b in rotary)
    if rope == "auto":
        both = rotary and hands_angles and objective == "quality"
        return ["commute", "reconstruct"] if both else ["commute"]
    if rope == "reconstruct" and not hands_angles:
        raise ValueError(
            f"rope='reconstruct' needs the RoPE angles of each step, but the attention modules "
            f"of {type(model).__name__} do not take `position_embeddings`; use rope='commute'")
    return [rope]


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


def _layer_inputs(model: nn.Module, blocks: list[AttentionBlock], shards: int
                  ) -> list[LayerInput]:
    """The layers' weights and layouts, with the layers transformers builds its own cache
    layer for marked (they stay full, as built)."""
    inputs = layer_inputs(named_params(model), blocks, shards)
    kept = layers_kept_as_built(getattr(model, "config", None))
    for layer in inputs:
        if layer.layer in kept:
            layer.compress_k = layer.compress_v = False
            layer.kept_as_built = True
            layer.note = (f"kept full: transformers builds its own {kept[layer.layer]} cache "
                          "layer here")
    return inputs


def _plan_inputs(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions
                 ) -> tuple[PlanOptions, list[LayerInput], str]:
    """The options with the basis resolved for one RoPE mode, the layers' inputs (bases'
    metrics attached) and the basis note."""
    basis, metrics, note = resolve(options.basis, model, blocks, options)
    options = replace(options, basis=basis)
    inputs = _layer_inputs(model, blocks, options.shards)
    block_of = {b.layer: b for b in blocks}
    for layer in inputs:
        metric = metrics.get(layer.layer)
        if metric is not None:
            layer.input_gram = metric.input_gram
            layer.k_spectrum, layer.v_spectrum = metric.k_spectrum, metric.v_spectrum
            if metric.k_of_cached_keys and not layer.compress_k and not layer.kept_as_built \
                    and block_of[layer.layer].k_path == "norm":
                layer.compress_k, layer.keys_after_rope = True, True
                layer.note = "keys behind a norm: basis of the keys the cache receives"
    return options, inputs, note


def _plan_candidate(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                    inputs: list[LayerInput], note: str, measure: bool
                    ) -> tuple[Plan, float | None]:
    """The low-rank plan of one candidate (``options`` say its RoPE mode and latent bits)
    and, where ``measure`` asks (or the split search measures anyway), its held-out
    calibration loss."""
    calibrated = options.basis in CALIBRATED_BASES
    loss = None
    if calibrated and options.schedule == "calibrated" and options.key_fraction is None:
        key_fraction, loss = measured_split(model, blocks, inputs, options)
        options = replace(options, key_fraction=key_fraction)
    result = plan_layers(inputs, options)
    result.basis_note = note
    if loss is None and measure:
        loss = held_out_loss(model, blocks, result)
    return result, loss


def checked_options(cache_fraction: float = 0.6, *, schedule: str = "calibrated",
                    rope: str = "auto", basis: str = "auto",
                    skip_threshold: float | None = None, keep_first: int = 0,
                    rank_multiple: int = 8, key_fraction: float | None = None,
                    calibration: CalibrationOptions | None = None,
                    objective: str = "quality", latent_bits: int | str | None = None,
                    latent_group: int | None = None, bits_per_value: float | None = None,
                    shards: int | None = None) -> PlanOptions:
    """The options :func:`plan` takes, checked without a model (a bad one raises a
    ``ValueError`` naming it and its valid range); ``rope="auto"`` is recorded as the first
    mode :func:`rope_modes` tries, ``latent_bits`` "auto" (or ``None``) as 16; ``shards=None`` as 1 (:func:`plan` takes a tensor-parallel
    model's split). ``cache_fraction`` (default 0.6) and ``bits_per_value`` are two ways to
    say the budget: give one."""
    if rope not in ("auto", *ROPE_MODES):
        raise ValueError(f"unknown rope mode {rope!r}; choose from {['auto', *ROPE_MODES]}")
    if shards is not None and shards != 1 and rope == "reconstruct":
        raise ValueError("rope='reconstruct' has no per-shard form yet (shards > 1): each "
                         "process would keep its own RoPE angle log; use rope='commute'")
    if cache_fraction is not None and bits_per_value is not None:
        raise ValueError(f"give cache_fraction or bits_per_value, not both (got cache_fraction="
                         f"{cache_fraction!r}, bits_per_value={bits_per_value!r}): both say the "
                         "cache's budget")
    searched = latent_bits is None or latent_bits == "auto"
    if not searched and (not isinstance(latent_bits, int) or isinstance(latent_bits, bool)
                         or latent_bits not in LATENT_BITS):
        raise ValueError(f"latent_bits must be one of {[*LATENT_BITS, 'auto']}, got {latent_bits!r}")
    return PlanOptions(cache_fraction=0.6 if cache_fraction is None else cache_fraction,
                       bits_per_value=bits_per_value, schedule=schedule,
                       rope="commute" if rope == "auto" else rope, basis=basis,
                       skip_threshold=skip_threshold, keep_first=keep_first,
                       rank_multiple=rank_multiple, key_fraction=key_fraction,
                       calibration=calibration or CalibrationOptions(), objective=objective,
                       latent_bits=16 if searched else latent_bits,
                       latent_group=LATENT_GROUPS[0] if latent_group is None else latent_group,
                       shards=1 if shards is None else shards)


def bit_choices(latent_bits: int | str | None, searchable: bool) -> tuple[int, ...]:
    """The latent bit widths to plan: the one asked, else (``"auto"``/``None``) all of
    ``LATENT_BITS`` where the plan can measure them (``searchable``), else 16."""
    if latent_bits not in (None, "auto"):
        return (latent_bits,)
    return LATENT_BITS if searchable else (16,)


def group_choices(latent_group: int | None, widths: tuple[int, ...]) -> tuple[int, ...]:
    """The group sizes to plan: the one asked, else both of ``LATENT_GROUPS`` where the bit
    width is searched, else the first."""
    if latent_group is not None:
        return (latent_group,)
    return LATENT_GROUPS if len(widths) > 1 else LATENT_GROUPS[:1]


def check_budget(cache_fraction: float | None, bits_per_value: float | None,
                  max_ppl_increase: float | None) -> None:
    """One way to say the budget: ``cache_fraction``, ``bits_per_value`` or
    ``max_ppl_increase`` (a ``ValueError`` naming them where two are given)."""
    check_target(max_ppl_increase, cache_fraction)
    if max_ppl_increase is not None and bits_per_value is not None:
        raise ValueError("give bits_per_value or max_ppl_increase, not both: the target "
                         "chooses the budget")


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


def _require_attention(model: nn.Module, blocks: list[AttentionBlock]) -> None:
    if not any(b.supported for b in blocks):
        raise NoAttentionFound(model, blocks)


class NoAttentionFound(ValueError):
    """The analysis found no attention block it can compress in the model."""

    def __init__(self, model: nn.Module, blocks: list[AttentionBlock], why: str = ""):
        reasons = sorted({b.reason for b in blocks if b.reason})
        why = why or (f"its {len(blocks)} attention blocks are left alone: {'; '.join(reasons)}"
                      if blocks else "its traced forward holds no attention")
        super().__init__(f"no attention to compress in {type(model).__name__}: {why}")


def plan(model: nn.Module, cache_fraction: float | None = None, *,
         bits_per_value: float | None = None, max_ppl_increase: float | None = None,
         schedule: str = "calibrated",
         rope: str = "auto", basis: str = "auto", skip_threshold: float | None = None,
         keep_first: int = 0, rank_multiple: int = 8, key_fraction: float | None = None,
         calibration: CalibrationOptions | None = None, objective: str = "quality",
         latent_bits: int | str | None = None, latent_group: int | None = None,
         shards: int | None = None, progress: bool = True,
         blocks: list[AttentionBlock] | None = None) -> Plan:
    """Per-layer LoRC ranks and bases for ``model`` keeping ``cache_fraction`` of its K/V
    cache (default 0.6), or ``bits_per_value``, or, with ``max_ppl_increase=t``, the smallest
    fraction on a grid of 0.05 whose perplexity on held-out calibration windows is at most
    ``1 + t`` times the uncompressed model's (``lorc_fx.search.fraction``; the plan's
    ``fraction_search`` says what was measured).

    ``blocks`` defaults to :func:`lorc_fx.analyze` of the model. ``basis="auto"`` picks the
    best basis calibration allows (``lorc_fx.plan.bases.resolve``); ``calibration`` says which
    text the data-aware bases measure (default: :class:`CalibrationOptions`, text sampled
    from the model itself; a named text this machine lacks becomes that too, with a
    warning); measurements are cached on disk. With the ``calibrated`` schedule, a
    data-aware basis and no ``key_fraction``, the key/value split is measured too
    (``lorc_fx.search.split``).
    ``rope="auto"`` plans both RoPE modes (:func:`rope_modes`) and keeps the one with the
    lower held-out calibration loss; without calibration, ``commute``. Caching keys before
    RoPE lets a data-aware key basis ignore the rotation (bench/quality.md: much better on
    SmolLM2), but the cache then keeps the angles too, which a small model's budget may not
    repay; and decode then rebuilds keys over the whole context every step, which on CPU costs
    about what full attention does (bench/results/long_context_lowrank-cpu.md):
    ``objective="speed"`` plans ``commute`` only. The plan's options record the basis and
    mode used. A model without attention
    the analysis can compress raises :class:`NoAttentionFound`.

    The budget is the cache's bytes, everything counted (latent codes, their scales and zero
    points, the RoPE angle log): ``cache_fraction`` of the uncompressed cache in the model's
    dtype (default 0.6), or ``bits_per_value`` per cached K/V value with every stored float
    at 16 bits (16: an uncompressed 16-bit cache), not both. ``latent_bits`` stores latents
    as 8- or 4-bit codes (``latent_group`` tokens per scale, default 32), or 16 (the model's
    dtype); ``"auto"`` (the default) measures plain 8- and 4-bit KV quantization first (keys
    per channel, values per token: KIVI's layout), then every latent width with the rank
    planner filling the budget (and, unless ``latent_group`` is given, groups of 32 and 64),
    and keeps the least held-out loss; a plain candidate within ``NEGLIGIBLE_LOSS`` of the
    uncompressed model's loss ends the search before any calibration
    (``lorc_fx.search.bits``; ``progress``: a progress bar). ``Plan.candidates`` lists what
    was measured. ``"auto"`` is 16 where the plan measures nothing (a budget of the whole
    cache, which stays exact; ``basis`` ``weight`` or ``norm`` with a ``cache_fraction``).

    ``shards`` > 1 makes every basis block-diagonal over that many equal groups of KV heads,
    the same rank in each (the whole-model plan a tensor-parallel model is cached by, each
    process holding its heads' latents). On a model loaded tensor-parallel (``tp_plan``) it
    is the model's split (``None``: taken from the model); every process plans the same
    whole-model plan from the gathered K/V weights (collectives, so call it on every
    process). Per-shard plans take ``rope='commute'`` and bases other than ``attention``
    (``basis='auto'`` is then ``whitened``, with a warning).
    """
    check_budget(cache_fraction, bits_per_value, max_ppl_increase)
    common = dict(schedule=schedule, rope=rope, skip_threshold=skip_threshold,
                  keep_first=keep_first, rank_multiple=rank_multiple, key_fraction=key_fraction,
                  calibration=calibration, objective=objective, latent_bits=latent_bits,
                  latent_group=latent_group, bits_per_value=bits_per_value)
    checked_options(cache_fraction, basis=basis, shards=shards, **common)
    if blocks is None:
        blocks = analyze(model)
    _require_attention(model, blocks)
    shards = _shards(blocks, shards)
    if shards > 1 and basis == "auto":
        log.warning("basis 'auto' over %d shards of the KV heads: low-rank candidates use "
                    "'whitened' (the attention-aware basis has no per-shard form yet)", shards)
        basis = "whitened"
    options = checked_options(cache_fraction, basis=basis, shards=shards, **common)
    calibrates = basis == "auto" or basis in CALIBRATED_BASES or max_ppl_increase is not None
    if calibrates or bits_per_value is not None:
        options = replace(options, calibration=usable_calibration(model, options.calibration))
    widths = bit_choices(latent_bits, searchable=not options.unchanged and (
        calibrates or bits_per_value is not None) and can_read(model, options.calibration))
    groups = group_choices(latent_group, widths)
    modes = ["commute"] if shards > 1 and rope == "auto" else rope_modes(rope, model, blocks,
                                                                          objective)
    measure = len(modes) > 1 or len(widths) > 1 or max_ppl_increase is not None
    first, start = None, time.perf_counter()
    if calibrates or len(widths) > 1:
        plain_first = len(widths) > 1 and _plain_fits(model, blocks, options, widths, groups)
        first = _announce_first_plan(model, blocks, options, modes, measure, plain_first)
        wanted = ([] if plain_first else [options.calibration]) + (
            [held_out_calibration(options)]
            if measure or (schedule == "calibrated" and key_fraction is None) else [])
        _sample_ahead(model, blocks, options, wanted)
    if max_ppl_increase is None:
        best, _ = _best_plan(model, blocks, options, modes, measure, widths, groups, progress)
    else:
        best = _plan_within(model, blocks, options, modes, max_ppl_increase, widths, groups)
    if first is not None:
        log.warning("lorc_fx: first plan made in %.0f s; later plans of this model reuse what %s "
                    "keeps", time.perf_counter() - start, first)
    return replace(best, fingerprint=plan_file.plan_fingerprint(model),
                   model_name=plan_file.model_name(model))


def _plain_fits(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                widths: tuple[int, ...], groups: tuple[int, ...]) -> bool:
    """Whether plain quantization at the widest searched width below 16 fits the budget
    (its candidates are measured first, and may end the search before any calibration)."""
    bits = max(w for w in widths if w != 16)
    plan = plain_quantized_plan(_layer_inputs(model, blocks, options.shards),
                                replace(options, latent_bits=bits, latent_group=max(groups)))
    return not over_budget(plan)


def _announce_first_plan(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                         modes: list[str], measure: bool, plain_first: bool) -> Path | None:
    """Where a first plan of ``model`` with these calibration options keeps what it
    measures, after one warning saying what it does; ``None`` where the model was sampled
    (or calibrated) before."""
    if cache_path(model, blocks, options.calibration).is_file() or (
            sampled_before(model, held_out_calibration(options)) and measure):
        return None
    where = user_cache_dir() / "calibration"
    low_rank = ("attention statistics and the key/value split of "
                f"{' and '.join(modes)} RoPE mode(s) for low-rank candidates")
    steps = ["sampling text from the model"] if SELF_TEXT in options.calibration.texts else []
    if plain_first:
        steps.append("measuring plain 8- and 4-bit KV quantization on held-out windows of it, "
                     f"then, unless one is within noise of the full cache, {low_rank}")
    else:
        steps += ["measuring candidate plans on held-out windows of it"] if measure else []
        steps.append(low_rank)
    log.warning("lorc_fx: first plan of %s: %s (up to minutes on a CPU; progress below), kept "
                "in %s for later plans. A saved plan skips it all: report.save(path), then "
                "compress(model, plan=path)", type(model).__name__, ", ".join(steps), where)
    return where


def _best_plan(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
               modes: list[str], measure: bool, widths: tuple[int, ...] | None = None,
               groups: tuple[int, ...] | None = None, progress: bool = False,
               full_loss: float | None = None) -> tuple[Plan, float | None]:
    """The plan of the candidate with the least held-out calibration loss (measured where
    ``measure`` asks, else the first candidate that plans), and that loss. Candidates: every
    RoPE mode in ``modes`` at every latent bit width in ``widths`` and group size in
    ``groups`` (default: the options'), and, where the width is searched, plain KV
    quantization, measured first: a candidate within ``NEGLIGIBLE_LOSS`` of the uncompressed
    model's held-out loss (``full_loss``, measured here if not given) ends the search
    (``lorc_fx.search.bits``), before any calibration a low-rank candidate needs."""
    widths = widths or (options.latent_bits,)
    groups = groups or (options.latent_group,)
    listed = candidates(modes, widths, groups, plain=len(widths) > 1)
    prepared: dict[str, tuple[PlanOptions, list[LayerInput], str]] = {}
    splits: dict[tuple[str, int], float] = {}  # measured once per mode and width

    def build(candidate: Candidate) -> tuple[Plan, float | None]:
        asked = replace(options, latent_bits=candidate.latent_bits,
                        latent_group=candidate.latent_group)
        if candidate.plain:  # no basis to calibrate: the keys and values themselves
            plain = plain_quantized_plan(_layer_inputs(model, blocks, options.shards), asked)
            if over_budget(plain):  # said before measuring what would be left out anyway
                raise UnreachableFraction(f"{candidate.name} is over the budget", math.inf)
            return plain, held_out_loss(model, blocks, plain) if measure else None
        if candidate.rope not in prepared:
            prepared[candidate.rope] = _plan_inputs(model, blocks,
                                                    replace(options, rope=candidate.rope))
        resolved, inputs, note = prepared[candidate.rope]
        if candidate.vector:
            if options.shards > 1:
                raise UnreachableFraction(f"{candidate.name}: not planned over shards", math.inf)
            cheapest = plain_quantized_plan(_layer_inputs(model, blocks, options.shards),
                                            replace(options, latent_bits=min(widths),
                                                    latent_group=max(groups)))
            if not over_budget(cheapest):
                raise UnreachableFraction(f"{candidate.name}: planned only where plain "
                                          "quantization does not fit the budget", math.inf)
            coded, loss = vector_candidate(model, blocks, resolved, inputs, note)
            return coded, loss if measure else None
        if candidate.keys_waterfilled:
            if options.shards > 1:
                raise UnreachableFraction(f"{candidate.name}: not planned over shards", math.inf)
            waterfilled = keys_waterfilled_candidate(
                model, blocks, replace(resolved, latent_bits=candidate.latent_bits,
                                       latent_group=candidate.latent_group), inputs, note)
            return waterfilled, held_out_loss(model, blocks, waterfilled) if measure else None
        # RoPE modes are compared where the basis is calibrated; bit widths always
        measured = measure and (resolved.basis in CALIBRATED_BASES or len(widths) > 1)
        asked = replace(resolved, latent_bits=candidate.latent_bits,
                        latent_group=candidate.latent_group,
                        key_fraction=splits.get((candidate.rope, candidate.latent_bits),
                                                resolved.key_fraction))
        result, loss = _plan_candidate(model, blocks, asked, inputs, note, measured)
        if len(groups) > 1:
            splits.setdefault((candidate.rope, candidate.latent_bits), result.options.key_fraction)
        return result, loss

    enough = None
    if measure and any(c.plain for c in listed):
        if full_loss is None:
            full_loss = calibration_loss(model, blocks, None, held_out_windows(model, options))
        enough = full_loss + NEGLIGIBLE_LOSS
    return best_candidate(build, listed, progress, enough)


def _plan_within(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                 modes: list[str], max_ppl_increase: float, widths: tuple[int, ...],
                 groups: tuple[int, ...]) -> Plan:
    """The plan at the smallest fraction meeting ``max_ppl_increase``, with its search."""
    from tqdm.auto import tqdm

    full_loss = calibration_loss(model, blocks, None, held_out_windows(model, options))
    plans: dict[float, Plan] = {}

    def loss_at(fraction: float) -> float:
        try:
            plans[fraction], loss = _best_plan(
                model, blocks, replace(options, cache_fraction=fraction), modes, True, widths,
                groups, full_loss=full_loss)
        except UnreachableFraction:
            return math.inf
        return held_out_loss(model, blocks, plans[fraction]) if loss is None else loss

    log.warning("lorc_fx: finding the smallest cache fraction within +%.3g%% perplexity on "
                "held-out calibration text (one plan per fraction tried)", 100 * max_ppl_increase)
    with tqdm(total=bisection_steps(), desc="cache fraction search", unit="plan") as bar:
        search = smallest_fraction(loss_at, full_loss, max_ppl_increase, bar.update)
        bar.total = bar.n  # bisection may stop early
    chosen = plans.get(search.chosen)
    if chosen is None:  # 1.0: every smaller fraction tried missed the target
        chosen, _ = _best_plan(model, blocks, replace(options, cache_fraction=search.chosen),
                               modes, False)
    log.info("lorc_fx: cache fraction %.2f chosen for max_ppl_increase=%g (held-out ×%.4f)",
             search.chosen, max_ppl_increase, search.ratios.get(search.chosen, 1.0))
    return replace(chosen, fraction_search=search.to_json())


_plan = plan  # ``compress`` takes a ``plan=`` argument


def load_plan(path: str | os.PathLike, model: nn.Module | None = None,
              blocks: list[AttentionBlock] | None = None) -> Plan:
    """The plan :func:`save_plan` wrote to ``path`` (a file, or a directory holding
    ``lorc_plan.safetensors``). With ``model``, it is checked against it: a plan for another
    model (by fingerprint), or whose layers are not the model's attention blocks
    (``blocks``, default: :func:`analyze`), raises a ``ValueError`` naming the file."""
    loaded = plan_file.load_plan(path)
    if model is not None:
        plan_file.check_fits(loaded, model, analyze(model) if blocks is None else blocks,
                             plan_file.plan_path(path))
    return loaded


def save_plan(source: nn.Module | Plan | CompressionReport, path: str | os.PathLike):
    """Write the plan of ``source`` (a model :func:`compress` compressed, its report, or a
    :func:`plan`) to ``path``: one safetensors file (``lorc_plan.safetensors`` where ``path``
    is a directory) with the bases as tensors and the ranks, options and the model's
    fingerprint as JSON metadata (docs/design.md, "The plan file"). Logs the file written,
    once, at INFO, and returns its path. ``compress(model, plan=path)`` installs it again."""
    if isinstance(source, CompressionReport):
        source = source.plan
    if isinstance(source, nn.Module):
        planned = getattr(source, "_lorc_whole_plan", None)
        if planned is None:
            raise ValueError(f"{type(source).__name__} was not compressed: there is no plan to "
                             "save (call lorc_fx.compress(model, ...) first)")
        if planned.fingerprint is None:
            planned = replace(planned, fingerprint=plan_file.plan_fingerprint(source),
                              model_name=plan_file.model_name(source))
        source = planned
    if not isinstance(source, Plan):
        raise TypeError(f"save_plan saves the plan of a compressed model, a CompressionReport "
                        f"or a Plan, not {type(source).__name__}")
    return plan_file.save_plan(source, path)


def compress(model: nn.Module, cache_fraction: float | None = None, *,
             plan: str | os.PathLike | Plan | None = None,
             blocks: list[AttentionBlock] | None = None, progress: bool = True,
             **plan_options) -> CompressionReport:
    """Plan LoRC ranks for ``model`` (keeping ``cache_fraction`` of its cache, default 0.6, or
    ``bits_per_value``, or the least fraction within ``max_ppl_increase``; options as for
    :func:`plan`) and make its ``generate`` use a latent KV cache.

    ``plan`` installs a plan instead: a path :func:`save_plan` wrote (or a :class:`Plan`);
    nothing is calibrated or planned, only analysed, and a plan for another model, or one
    whose layers are not this model's attention blocks, is refused with a ``ValueError``.

    Returns a report: per-layer ranks, cache bytes per token full vs compressed, and the
    attention blocks left uncompressed with the reason; ``report.save(path)`` writes its plan.
    A model with no attention the analysis can compress is left unchanged, with a warning
    and a report that says why.
    """
    if plan is not None and (cache_fraction is not None or plan_options):
        given = (["cache_fraction"] if cache_fraction is not None else []) + sorted(plan_options)
        raise ValueError(f"compress(plan=...) installs a saved plan as it is; "
                         f"{', '.join(given)} cannot change it (plan again without plan=)")
    if plan is None:  # bad options fail before any analysis
        check_budget(cache_fraction, plan_options.get("bits_per_value"),
                      plan_options.get("max_ppl_increase"))
        checked_options(cache_fraction,
                        **{k: v for k, v in plan_options.items() if k != "max_ppl_increase"})
    dtype_bytes = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    try:
        if blocks is None:
            blocks = analyze(model)
        _require_attention(model, blocks)
    except (NoAttentionFound, NoTokenInputs) as err:
        why = err if isinstance(err, NoAttentionFound) else NoAttentionFound(model, [], str(err))
        log.warning("lorc_fx.compress: %s; the model is left unchanged", why)
        return CompressionReport(None, [(b.layer, b.reason) for b in blocks or []], dtype_bytes,
                                 left_alone=str(why))
    if plan is None:
        planned = _plan(model, cache_fraction, blocks=blocks, progress=progress, **plan_options)
    elif isinstance(plan, Plan):
        plan_file.check_fits(plan, model, blocks)
        planned = plan
    else:
        planned = load_plan(plan, model, blocks)
    install(model, planned, blocks)
    unsupported = [(b.layer, b.reason) for b in blocks if not b.supported]
    return CompressionReport(planned, unsupported, dtype_bytes)
