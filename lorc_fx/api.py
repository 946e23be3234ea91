"""The user's entry points: ``analyze`` a model's attention, ``plan`` how its cache is stored,
``compress`` it, ``save_plan`` / ``load_plan`` to compress it again later without planning.

Orchestration only: each stage's work lives in its package (``analysis`` → ``plan`` →
``cache``), the plan search in ``search`` over the storage schemes of ``schemes``. Options
are a :class:`~lorc_fx.plan.options.PlanOptions` or keyword overrides of its defaults,
checked once, before any model is traced."""
from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

import lorc_fx.schemes  # noqa: F401  (registers the storage schemes)
from lorc_fx.analysis import analyze
from lorc_fx.analysis.cache_probe import own_cache_class, probe_cache
from lorc_fx.analysis.capture import NoTokenInputs, NotTraceable
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache import install, layers_kept_as_built
from lorc_fx.plan import plan_file
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import Plan
from lorc_fx.report import CompressionReport
from lorc_fx.schemes.plain import NoGraphPlan, plan_without_graph
from lorc_fx.search.context import declined_layer_inputs
from lorc_fx.search.planning import plan_model

log = logging.getLogger(__name__)


class NoAttentionFound(ValueError):
    """The analysis found no attention block it can compress in the model."""

    def __init__(self, model: nn.Module, blocks: list[AttentionBlock], why: str = ""):
        reasons = sorted({b.reason for b in blocks if b.reason})
        kept = layers_kept_as_built(getattr(model, "config", None))
        if not why and any(b.supported for b in blocks):
            why = ("every attention layer it could compress keeps the cache layer transformers "
                   "builds for it, which lorc_fx stores as built: "
                   + ", ".join(f"layer {b.layer} {kept[b.layer]}" for b in blocks
                            if b.layer in kept)
                   + (f"; the others are left alone: {'; '.join(reasons)}" if reasons else ""))
        why = why or (f"its {len(blocks)} attention blocks are left alone: {'; '.join(reasons)}"
                      if blocks else "its traced forward holds no attention")
        super().__init__(f"no attention to compress in {type(model).__name__}: {why}")


def compressible(model: nn.Module, blocks: list[AttentionBlock]) -> bool:
    """Whether any block is supported and writes a cache layer the latent cache replaces
    (not one transformers builds its own kind of: linear attention, a model's own layer
    class, ...). Raises :class:`NoAttentionFound` where a forward shows the model caching in
    a class of its own that lorc_fx cannot build (MiniMax's it can: ``own_cache_class``) or
    leaving the cache without keys and values (XLM)."""
    kept = layers_kept_as_built(getattr(model, "config", None))
    if not any(b.supported and b.layer not in kept for b in blocks):
        return False
    probe = probe_cache(model)
    if probe is not None and probe.cache_class not in (DynamicCache, None, own_cache_class(model)):
        raise NoAttentionFound(model, blocks, f"it caches in a class of its own "
                               f"({probe.cache_class.__name__}), which lorc_fx cannot build (it "
                               "builds a DynamicCache subclass that adds transformers' "
                               "DynamicLayer as each is written)")
    if probe is not None and not probe.layers:
        raise NoAttentionFound(model, blocks, "its cache holds no keys and values after a "
                               "forward (the model keeps them its own way, or none)")
    return True


def plan(model: nn.Module, cache_fraction: float | None = None, *,
         options: PlanOptions | None = None, progress: bool = True,
         blocks: list[AttentionBlock] | None = None, **overrides) -> Plan:
    """How ``model``'s cache is stored for a budget: ``options`` (a :class:`PlanOptions`,
    default its defaults) with ``cache_fraction`` and any keyword ``overrides`` of its fields
    (the fields' metadata say each one's meaning and range; a bad one raises a
    ``ValueError`` naming it before the model is traced).

    The budget is the cache's bytes, everything counted (codes, their scales and zero
    points, sinks, the RoPE angle log): ``cache_fraction`` of the uncompressed cache in the
    model's dtype (default 0.6), or ``bits_per_value`` per cached K/V value with every stored
    float at 16 bits (16: an uncompressed 16-bit cache), or, with ``max_ppl_increase=t``, the
    smallest fraction on a grid of 0.05 whose perplexity on held-out calibration windows is
    at most ``1 + t`` times the uncompressed model's (the plan's ``fraction_search`` says
    what was measured).

    ``latent_bits="auto"`` (the default) measures every registered storage scheme's
    candidates (``lorc_fx.schemes``: plain 8- and 4-bit KV quantization first, keys
    water-filled, vector codes below what plain quantization fits, then, where vector codes
    do not plan, low rank at 16-, 8- and 4-bit latents with the rank filling the budget) on
    held-out text sampled from the model and keeps the least loss; a plain candidate within
    noise of the uncompressed model's loss ends the search before any calibration
    (``Plan.candidates`` lists what was measured, and what was skipped and why).
    ``latent_bits=16 | 8 | 4`` plans low rank alone at that width. "auto" is 16 where
    nothing is measured (a budget of the whole cache, which stays exact; ``basis``
    ``weight`` or ``norm`` with a ``cache_fraction``).

    ``basis="auto"`` picks the best basis calibration allows (``lorc_fx.plan.bases.resolve``);
    ``calibration`` says which text the data-aware bases measure (default: text sampled from
    the model itself; a named text this machine lacks becomes that too, with a warning);
    measurements are cached on disk. ``rope="auto"`` plans both RoPE modes and keeps the one
    with the lower held-out loss: caching keys before RoPE lets a data-aware key basis ignore
    the rotation, but keeps the angles too and rebuilds keys over the whole context every
    decode step (bench/results/long_context_lowrank-cpu.md): ``objective="speed"`` plans one
    mode, keys in a RoPE-commuting basis (before RoPE where the model hands attention its
    angles, scored per rotary pair without a rebuild; else after it). The plan's options
    record the choices made.

    ``shards`` > 1 makes every basis block-diagonal over that many equal groups of KV heads
    (the whole-model plan a tensor-parallel model is cached by, each process holding its
    heads' latents). On a model loaded tensor-parallel it is the model's split (``None``:
    taken from the model); every process plans the same whole-model plan from the gathered
    K/V weights (collectives: call it on every process). A model whose attention the
    analysis declines (MLA, custom eager attention) gets a plain plan of what transformers'
    cache holds for it, chosen by bits alone (nothing can be measured without the graph:
    ``schemes.plain.plan_without_graph``); one where no cache layer holds keys and values,
    or whose options need the graph (``latent_bits=16``, ``max_ppl_increase``, the whole
    cache), raises :class:`NoAttentionFound`."""
    options = PlanOptions.of(options, **_with_fraction(cache_fraction, overrides))
    if blocks is None:
        blocks = analyze(model)
    if not compressible(model, blocks):
        try:  # plain codes need no proof: only what the cache stores changes
            return _plain_without_graph(model, blocks, NoAttentionFound(model, blocks), options)
        except NoGraphPlan:
            raise NoAttentionFound(model, blocks) from None
    return _planned(model, blocks, options, progress)


def _planned(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
             progress: bool) -> Plan:
    """The search's plan of a model :func:`compressible` passed, with its fingerprint."""
    planned = plan_model(model, blocks, options, progress)
    return replace(planned, fingerprint=plan_file.plan_fingerprint(model),
                   model_name=plan_file.model_name(model))


def _dtype_bits(model: nn.Module) -> int:
    return 8 * torch.empty((), dtype=next(model.parameters()).dtype).element_size()


def _plain_without_graph(model: nn.Module, blocks: list[AttentionBlock], err: Exception,
                         options: PlanOptions) -> Plan:
    """The plain plan of every layer whose transformers cache holds keys and values
    (``cache.probe``), for a model whose attention the analysis declined (``why``, and each
    block's own reason): coding what a cache layer stores needs no proof from the graph.
    Raises :class:`NoGraphPlan` where the options ask for what needs the graph or no cache
    layer holds keys and values, ``UnreachableFraction`` where no plain plan fits."""
    if isinstance(err, NoTokenInputs):
        raise NoGraphPlan(str(err))
    why = _declined(err)
    inputs = declined_layer_inputs(model, blocks, why)
    if not inputs:
        raise NoGraphPlan(str(err))
    planned = plan_without_graph(inputs, options, _dtype_bits(model), why)
    return replace(planned, fingerprint=plan_file.plan_fingerprint(model),
                   model_name=plan_file.model_name(model))


def compress(model: nn.Module, cache_fraction: float | None = None, *,
             plan: str | os.PathLike | Plan | None = None, options: PlanOptions | None = None,
             blocks: list[AttentionBlock] | None = None, progress: bool = True,
             **overrides) -> CompressionReport:
    """Plan how ``model``'s cache is stored (:func:`plan`'s options: ``cache_fraction``,
    default 0.6, ``bits_per_value`` or ``max_ppl_increase``, ...) and make its ``generate``
    use that latent KV cache.

    ``plan`` installs a plan instead: a path :func:`save_plan` wrote (or a :class:`Plan`);
    nothing is calibrated or planned, only analysed, and a plan for another model, or one
    whose layers are not this model's attention blocks, is refused with a ``ValueError``.

    Returns a report: what each layer stores, cache bytes per token full vs compressed, and
    the attention blocks left uncompressed with the reason; ``report.save(path)`` writes its
    plan. Where the analysis declines the attention (or cannot trace the model), the layers
    whose transformers cache holds keys and values are stored as plain codes chosen by bits
    alone, each layer's note saying why nothing else is (:func:`plan`); a model with nothing
    to code that way, or options that need the graph, is left unchanged, with a warning and
    a report that says why.
    """
    if plan is not None and (cache_fraction is not None or options is not None or overrides):
        given = (["cache_fraction"] if cache_fraction is not None else []) \
            + (["options"] if options is not None else []) + sorted(overrides)
        raise ValueError(f"compress(plan=...) installs a saved plan as it is; "
                         f"{', '.join(given)} cannot change it (plan again without plan=)")
    if plan is None:  # bad options fail before any analysis
        options = PlanOptions.of(options, **_with_fraction(cache_fraction, overrides))
    dtype_bytes = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    try:
        if blocks is None:
            blocks = analyze(model)
        if not compressible(model, blocks):
            raise NoAttentionFound(model, blocks)
    except (NoAttentionFound, NoTokenInputs, NotTraceable) as err:
        why = err if isinstance(err, NoAttentionFound) else NoAttentionFound(model, [], str(err))
        unsupported = [(b.layer, b.reason) for b in blocks or []]
        try:  # plain codes need no proof: only what the cache stores changes
            if plan is not None:
                raise NoGraphPlan(f"{why} (a saved plan installs only on attention the analysis "
                                  "proves: plan this model again instead)")
            planned = _plain_without_graph(model, blocks or [], why, options)
        except NoGraphPlan as left:
            log.warning("lorc_fx.compress: %s; the model is left unchanged", left)
            return CompressionReport(None, unsupported, dtype_bytes, left_alone=str(left))
        log.warning("lorc_fx.compress: %s; its cache is stored as plain codes, chosen by bits "
                    "alone", why)
        install(model, planned, blocks or [])
        coded = {l.layer for l in planned.layers if not l.skipped}  # their notes say why
        return CompressionReport(planned, [(l, r) for l, r in unsupported if l not in coded],
                                 dtype_bytes)
    if plan is None:
        planned = _planned(model, blocks, options, progress)  # compressible, checked above
    elif isinstance(plan, Plan):
        plan_file.check_fits(plan, model, blocks)
        planned = plan
    else:
        planned = load_plan(plan, model, blocks)
    install(model, planned, blocks)
    coded = {l.layer for l in planned.layers if not l.skipped}  # a plain plan codes declined
    unsupported = [(b.layer, b.reason) for b in blocks   # layers too: their notes say why
                   if not b.supported and b.layer not in coded]
    return CompressionReport(planned, unsupported, dtype_bytes)


def _declined(err: Exception) -> str:
    """Why the analysis gave no block to compress, in its words (each declined block's own
    reason goes with its layer)."""
    if isinstance(err, NoAttentionFound):
        return str(err).split(": ", 1)[-1]
    return str(err)


def _with_fraction(cache_fraction: float | None, overrides: dict) -> dict:
    """``overrides`` with the positional ``cache_fraction`` among them, where given."""
    return overrides if cache_fraction is None else {**overrides, "cache_fraction": cache_fraction}


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
    is a directory) with the bases and codebooks as tensors and the ranks, codes, options and
    the model's fingerprint as JSON metadata (docs/design.md, "The plan file"). Logs the file
    written, once, at INFO, and returns its path. ``compress(model, plan=path)`` installs it
    again."""
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
