"""The user's entry points: ``analyze`` a model's attention, ``plan`` its ranks, ``compress`` it,
``save_plan`` / ``load_plan`` to compress it again later without planning.

Orchestration only: each stage's work lives in its package (``analysis`` → ``plan`` →
``cache``); what is measured through the real latent cache (the key/value split, the RoPE
mode) in ``search``."""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import replace

import torch
from torch import nn

from lorc_fx.analysis import analyze
from lorc_fx.analysis.capture import NoTokenInputs
from lorc_fx.analysis.records import AttentionBlock, attention_module, named_params
from lorc_fx.cache import install, layers_kept_as_built
from lorc_fx.plan import plan_file
from lorc_fx.plan.bases import resolve
from lorc_fx.plan.calibration import (CalibrationUnavailable, cache_path, calibration_tokenizer,
                                      sample_self_text, self_text_request, usable_calibration)
from lorc_fx.plan.options import ROPE_MODES, CalibrationOptions, PlanOptions
from lorc_fx.plan.planner import Plan, layer_inputs, plan_layers
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.report import CompressionReport
from lorc_fx.search.split import held_out_calibration, held_out_loss, measured_split

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
                  held_out: bool) -> None:
    """Before a first calibration on text sampled from the model, sample the calibration
    sequences and (``held_out``) those of the split search in one pass: side by side they
    cost little more than the calibration's alone."""
    if cache_path(model, blocks, options.calibration).is_file():
        return  # calibrated before: whatever is still needed is sampled where it is read
    wanted = [options.calibration] + ([held_out_calibration(options)] if held_out else [])
    requests = [r for r in map(self_text_request, wanted) if r is not None]
    if requests:
        try:
            sample_self_text(model, calibration_tokenizer(model, options.calibration), requests)
        except CalibrationUnavailable:
            pass  # resolve() falls back and says why


def _plan_mode(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
               measure: bool) -> tuple[Plan, float | None]:
    """A plan for one RoPE mode and, where calibration allows and ``measure`` asks (or the
    split search measures anyway), its held-out calibration loss."""
    basis, metrics, note = resolve(options.basis, model, blocks, options)
    options = replace(options, basis=basis)
    inputs = layer_inputs(named_params(model), blocks)
    kept = layers_kept_as_built(getattr(model, "config", None))
    block_of = {b.layer: b for b in blocks}
    for layer in inputs:
        if layer.layer in kept:
            layer.compress_k = layer.compress_v = False
            layer.note = (f"kept full: transformers builds its own {kept[layer.layer]} cache "
                          "layer here")
        metric = metrics.get(layer.layer)
        if metric is not None:
            layer.input_gram = metric.input_gram
            layer.k_spectrum, layer.v_spectrum = metric.k_spectrum, metric.v_spectrum
            if metric.k_of_cached_keys and not layer.compress_k and layer.layer not in kept \
                    and block_of[layer.layer].k_path == "norm":
                layer.compress_k, layer.keys_after_rope = True, True
                layer.note = "keys behind a norm: basis of the keys the cache receives"
    loss = None
    if basis in CALIBRATED_BASES and options.schedule == "calibrated" and options.key_fraction is None:
        key_fraction, loss = measured_split(model, blocks, inputs, options)
        options = replace(options, key_fraction=key_fraction)
    result = plan_layers(inputs, options)
    result.basis_note = note
    if basis in CALIBRATED_BASES and loss is None and measure:
        loss = held_out_loss(model, blocks, result)
    return result, loss


def checked_options(cache_fraction: float = 0.6, *, schedule: str = "calibrated",
                    rope: str = "auto", basis: str = "auto",
                    skip_threshold: float | None = None, keep_first: int = 0,
                    rank_multiple: int = 8, key_fraction: float | None = None,
                    calibration: CalibrationOptions | None = None,
                    objective: str = "quality", latent_bits: int = 16,
                    latent_group: int = 32) -> PlanOptions:
    """The options :func:`plan` takes, checked without a model (a bad one raises a
    ``ValueError`` naming it and its valid range); ``rope="auto"`` is recorded as the first
    mode :func:`rope_modes` tries."""
    if rope not in ("auto", *ROPE_MODES):
        raise ValueError(f"unknown rope mode {rope!r}; choose from {['auto', *ROPE_MODES]}")
    return PlanOptions(cache_fraction=cache_fraction, schedule=schedule,
                       rope="commute" if rope == "auto" else rope, basis=basis,
                       skip_threshold=skip_threshold, keep_first=keep_first,
                       rank_multiple=rank_multiple, key_fraction=key_fraction,
                       calibration=calibration or CalibrationOptions(), objective=objective,
                       latent_bits=latent_bits, latent_group=latent_group)


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


def plan(model: nn.Module, cache_fraction: float = 0.6, *, schedule: str = "calibrated",
         rope: str = "auto", basis: str = "auto", skip_threshold: float | None = None,
         keep_first: int = 0, rank_multiple: int = 8, key_fraction: float | None = None,
         calibration: CalibrationOptions | None = None, objective: str = "quality",
         latent_bits: int = 16, latent_group: int = 32,
         blocks: list[AttentionBlock] | None = None) -> Plan:
    """Per-layer LoRC ranks and bases for ``model`` keeping ``cache_fraction`` of its K/V cache.

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
    repay; and decode then rebuilds keys over the whole context every step, several times
    slower than the full cache at long context (bench/results/long_context-cpu.md):
    ``objective="speed"`` plans ``commute`` only. The plan's options record the basis and
    mode used. A model without attention
    the analysis can compress raises :class:`NoAttentionFound`.
    """
    options = checked_options(cache_fraction, schedule=schedule, rope=rope, basis=basis,
                              skip_threshold=skip_threshold, keep_first=keep_first,
                              rank_multiple=rank_multiple, key_fraction=key_fraction,
                              calibration=calibration, objective=objective,
                              latent_bits=latent_bits, latent_group=latent_group)
    if blocks is None:
        blocks = analyze(model)
    _require_attention(model, blocks)
    modes = rope_modes(rope, model, blocks, objective)
    if basis == "auto" or basis in CALIBRATED_BASES:
        options = replace(options, calibration=usable_calibration(model, options.calibration))
        _sample_ahead(model, blocks, options, held_out=len(modes) > 1 or (
            schedule == "calibrated" and key_fraction is None))
    planned, refused = [], []
    for mode in modes:
        try:
            result, loss = _plan_mode(model, blocks, replace(options, rope=mode), len(modes) > 1)
        except UnreachableFraction as err:
            refused.append(err)
            continue
        if loss is None:  # nothing to compare on: the first mode that plans
            planned = [(0.0, result)]
            break
        planned.append((loss, result))
    if not planned:
        raise refused[0]
    best = min(planned, key=lambda p: p[0])[1]
    return replace(best, fingerprint=plan_file.plan_fingerprint(model),
                   model_name=plan_file.model_name(model))


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
        planned = getattr(source, "_lorc_plan", None)
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
             blocks: list[AttentionBlock] | None = None, **plan_options) -> CompressionReport:
    """Plan LoRC ranks for ``model`` (keeping ``cache_fraction`` of its cache, default 0.6,
    options as for :func:`plan`) and make its ``generate`` use a latent KV cache.

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
    cache_fraction = 0.6 if cache_fraction is None else cache_fraction
    if plan is None:
        checked_options(cache_fraction, **plan_options)  # bad options fail before any analysis
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
        planned = _plan(model, cache_fraction, blocks=blocks, **plan_options)
    elif isinstance(plan, Plan):
        plan_file.check_fits(plan, model, blocks)
        planned = plan
    else:
        planned = load_plan(plan, model, blocks)
    install(model, planned, blocks)
    unsupported = [(b.layer, b.reason) for b in blocks if not b.supported]
    return CompressionReport(planned, unsupported, dtype_bytes)
