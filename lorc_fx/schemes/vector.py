"""Vector codes: every layer's keys (before RoPE) and values as latents of the calibrated
basis at full rank, each tuple of ``TUPLE_DIMS`` latent channels at the bits a token its
weight and measured coding error buy (0.5 to 6, or dropped), coded as indices into codebooks
fitted by k-means on calibration latents (``search.codebooks``; no per-token scales), each
row's first token kept as it came (the attention sink, ``cache.stores.vector``).

Planned only where no plain quantization fits the budget (below 4.5 bits per value on the
default model): its first fit takes minutes. Sliding-window layers, whose rings the vector
stores do not hold, store 4-bit plain codes (``SLIDING_BITS``), the rest of the budget left
to the other layers' vector codes. A channel's relative error is weighed by what the loss
minds it (``plan.sensitivity``: diagonal Fisher times the channel's power, where a
side's latent is linear in its projection), else by the spectra's energies; which share of
the bits the keys get (``KEY_SHARES``) is chosen by the held-out calibration loss. The shares
bracket the best found under either weighting (0.35-0.45 under the energies, 0.40-0.45 under
the sensitivities at 1.92-3 bits, in the run behind bench/results/bits_pareto-cpu.md, which
logs each at INFO). Where both can weigh, the sensitivities' best had the lower held-out loss
at every budget measured: by 0.002-0.007 nats there, by 0.013-0.015 at 1.92, 2.56 and 3 bits
on 2026-11-29 (the energies at the sensitivities' share), so the energies are no longer
measured beside them (a held-out loss, 6 s of a first plan).

Then the layers retrieval leans on (``search.retrieval_probe``: those whose codes alone move
multikey answers most) weigh ``PlanOptions.retrieval_weight`` (16) times more, at the weights
and share chosen, or its square root where that costs over ``RETRIEVAL_COST`` of held-out
loss: coded like the rest they lose keys the full cache finds, at a cost the selection above
would never pay (docs/retrieval.md, "The planner finds them").

Last, the same plan is made again with the answers of retrieval prompts weighing beside the
text (``search.answer_sensitivity``: what the answers' loss minds each channel's error) at
``PlanOptions.answer_weight`` (4) times the text's total, else half or a quarter of it; the
first whose plan costs at most ``RETRIEVAL_COST`` more held-out loss than the text's weights
alone with no layer favoured is the candidate (one cap for both retrieval levers: each under
its own, they cost 0.03 nats together on the default model at 2.56 bits and decoded news
with 61% more KL, retrieving no more). The text's loss spreads over every token and hardly
sees the few keys a long context's answer is read from (docs/retrieval.md, "The answers' own
sensitivities").
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.codes.vector import VectorBook, select
from lorc_fx.plan.calibration import calibration_tokenizer, calibration_windows
from lorc_fx.plan.options import LATENT_GROUPS, PlanOptions
from lorc_fx.plan.planner import (LayerInput, LayerPlan, Plan, key_energies, plan_layers,
                                  sliding_coded, value_energies, without_sliding_latents)
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.plan.scheme import Capabilities, Scheme, rank_table, register
from lorc_fx.plan.sensitivity import ProjectionMoments, Side, calibration_with_gradients
from lorc_fx.plan.vector_allocation import code_budget, vector_bits
from lorc_fx.search.answer_sensitivity import answer_length, with_answers
from lorc_fx.search.candidates import plain_fits
from lorc_fx.search.codebooks import (TUPLE_DIMS, WIDTHS, books_and_sensitivities, coded_sides,
                                      kept_answer_sensitivities)
from lorc_fx.search.context import Candidate, SearchContext, calibrated_basis
from lorc_fx.search.one_prefill import reads_side_by_side
from lorc_fx.search.retrieval_probe import kept_layer_damage, probe_length, retrieval_layers
from lorc_fx.search.split import held_out_loss

KEY_SHARES = (0.3, 0.35, 0.4, 0.45)  # keys' share of the codes' bits, measured
# what favouring the layers retrieval leans on may cost in held-out loss (nats): ×16 cost
# 0.010 at 2.56 bits and 0.035 at 1.92, where the plan decoded news at ×1.108 (docs/retrieval.md)
RETRIEVAL_COST = 0.02
# sliding-window layers, whose ring buffers vector codes do not store: plain codes at the
# narrowest width and the widest group the plain scheme plans (4.5 bits per value where a
# head has 64 channels or more)
SLIDING_BITS, SLIDING_GROUP = 4, max(LATENT_GROUPS)

log = logging.getLogger(__name__)


class Vector(Scheme):
    name = "vector"
    title = "vector codes"
    capabilities = Capabilities(static_cache=True, compiled_decode=True, shards=False)

    def candidates(self, search: SearchContext) -> list[Candidate]:
        """One, where the storage is searched: keys cached before RoPE where that mode is
        planned (the better loss, measured: docs/schemes/vector.md; under
        ``objective="speed"`` in a RoPE-commuting basis, scored per rotary pair, never
        rebuilt), else after it (decode scores them by table). One mode only: each fits its
        own codebooks, minutes of a first plan."""
        modes = [m for m in ("reconstruct", "commute") if m in search.modes]
        if not (search.searched and modes):
            return []
        mode = modes[0]
        name = (f"vector codes (tuples of {TUPLE_DIMS} latent channels at "
                f"{min(WIDTHS):g}-{max(WIDTHS):g} bits), rope={mode}")
        return [Candidate(name, self.name, lambda: self._build(search, name, mode), mode, 16,
                          search.groups[0])]

    def _build(self, search: SearchContext, name: str, mode: str) -> tuple[Plan, float | None]:
        if search.options.shards > 1:
            raise UnreachableFraction(f"{name}: not planned over shards", math.inf)
        if not any(l.compress_v for l in search.layer_inputs()):  # no latents to fit books on
            raise UnreachableFraction(f"{name}: no layer caches value latents", math.inf)
        if plain_fits(search, min(search.widths)):
            raise UnreachableFraction(f"{name}: planned only where plain quantization does not "
                                      "fit the budget", math.inf)
        projections = (calibration_with_gradients(search.model, search.blocks,
                                                  search.options.calibration)
                       if calibrated_basis(search.options.basis) else None)
        resolved, inputs, note = search.prepared(mode)
        plan, loss = vector_candidate(search.model, search.blocks, resolved, inputs, note,
                                      projections)
        return plan, loss if search.measure else None

    def how(self, plan: Plan) -> str:
        o = plan.options
        tails = ", codebook tails" if o.codebook_tails else ""
        answers = (f", retrieval answers weighed ×{o.answer_weight:g}" if o.answer_weight
                   else "")
        return f"vector codes; basis={o.basis}, rope={o.rope}{tails}{answers}"

    def limits(self) -> str:
        """Compiled decode reads the codes but is slower than the full cache's (measured in
        issue #37, bench/results/long_context_vector-cpu.md, runs 10-14)."""
        return ("compiled decode reads the codes (keys cached after RoPE) or rebuilds "
                "every key before RoPE each step (the default), and is slower than the full "
                "cache's (the default model after 4096 tokens, one CPU thread: 0.34-0.46x its "
                "speed at 2.56 bits; 0.59-0.70x with objective='speed', which scores keys from "
                "their codes and costs some quality; 0.76-0.78x with rope='commute', which "
                "costs more); Inductor takes 2-8 minutes to compile it")

    def summary(self, plan: Plan) -> str:
        channels, _ = _channels_per_width(plan)
        full, _ = plan.cache_elements_per_token()
        widths = " / ".join(f"{channels[b]}×{b:g}" for b in sorted(channels, reverse=True))
        return f"vector codes ({widths}-bit channels of {full}), {plan.options.rope}"

    def describe(self, plan: Plan) -> list[str]:
        answers = plan.options.answer_weight
        channels, table_bytes = _channels_per_width(plan)
        full = sum(l.k_full * l.k_compressible + l.v_full * l.v_compressible
                   for l in plan.layers if not l.skipped)  # the channels codes could keep
        widths = ", ".join(f"{channels[b]} at {b:g}" for b in sorted(channels, reverse=True))
        return rank_table(plan) + [
            f"vector codes: each latent channel at the bits a token its weight and measured "
            f"coding error buy, or dropped ({sum(channels.values())} of {full} channels kept: "
            f"{widths} bits), in tuples of channels coded as indices into codebooks fitted on "
            f"calibration latents (no scales"
            + ("; the 4- to 6-bit tables with levels past the calibration latents' range"
               if plan.options.codebook_tails else "")
            + ")"
            + (f"; a channel's weight adds what the answers of retrieval prompts mind its "
               f"error, at ×{answers:g} the text's total" if answers else "")
            + f"; the codebooks take {table_bytes / 2**20:.1f} MiB, "
            "the model's like its weights, not counted in bits per value; each sequence's first "
            "token is kept in full precision (the attention sink), counted as if sequences "
            "were 512 tokens; "
            + (f"the most recent 1/{plan.options.recent_divisor} of the tokens and "
               if plan.options.recent_divisor else "")
            + "the last partial block of 8 tokens are kept in full precision"
            + (f"; each {plan.options.drift_chunk}-token chunk of the context is coded about "
               "its mean latent's drift from the first chunk's (one row of offsets a chunk, "
               "measured at the prefill)" if plan.options.drift_chunk else "")]


def _channels_per_width(plan: Plan) -> tuple[dict[float, int], int]:
    """Latent channels stored at each width, all layers, and the bytes of the books' tables."""
    channels: dict[float, int] = {}
    table_bytes = 0
    for l in plan.layers:
        for book in (l.k_code, l.v_code):
            if isinstance(book, VectorBook):
                table_bytes += book.nbytes
                for count, bits in book.spec.runs:
                    channels[bits] = channels.get(bits, 0) + count
    return channels, table_bytes


def _coded(layer: LayerPlan, side: str, bits: list[float], books: dict[float, VectorBook],
           energy: torch.Tensor, tuple_dims: int, options: PlanOptions) -> LayerPlan:
    """``layer`` keeping the channels of ``side`` with nonzero ``bits``, coded by the book cut
    from ``books`` (``energy``: the channels' spectrum energies) with ``options``' drift
    offsets and recent window."""
    basis, rebuild = getattr(layer, f"{side}_basis"), getattr(layer, f"{side}_rebuild")
    if any(bits):
        book, kept = select(books, bits, tuple_dims)
        book = replace(book, drift_chunk=options.drift_chunk,
                       recent_divisor=options.recent_divisor)
    else:
        book, kept = None, torch.zeros(0, dtype=torch.long)
    total = float(energy.sum())
    return replace(layer, **{f"{side}_rank": len(kept), f"{side}_basis": basis[kept],
                             f"{side}_rebuild": rebuild[kept], f"{side}_code": book,
                             f"{side}_energy_kept": float(energy[kept].sum()) / total
                             if total > 0 else 1.0})


def vector_plan(full: Plan, inputs: list[LayerInput], options: PlanOptions,
                books: dict[Side, dict[float, VectorBook]],
                rho: dict[Side, dict[float, torch.Tensor]], key_share: float,
                weights: dict[Side, torch.Tensor] | None = None,
                favoured: dict[int, str] | None = None, tuple_dims: int = TUPLE_DIMS) -> Plan:
    """The vector plan at ``options``' budget from ``full`` (full rank, its basis rows in the
    order of the energies of ``inputs``) with ``books`` and their errors ``rho``, each
    channel's relative error weighed by ``weights`` (``plan.sensitivity``; ``None``: the
    spectra's energies), ``options.retrieval_weight`` times more in the ``favoured`` layers
    (layer -> why, which their plans' notes say)."""
    favoured = favoured or {}
    full = sliding_coded(full, inputs, SLIDING_BITS, SLIDING_GROUP)
    sides = coded_sides(full)
    keys = [s for s in sides if s[1] == "k"]
    values = [s for s in sides if s[1] == "v"]
    if not keys or not values:
        raise UnreachableFraction("vector codes: no layer caches both key and value latents", 0.0)
    index = {l.layer: i for i, l in enumerate(full.layers)}
    k_energy, v_energy = key_energies(inputs, options), value_energies(inputs)

    def weight(side: Side) -> torch.Tensor:
        w = weights[side] if weights is not None else \
            (k_energy if side[1] == "k" else v_energy)[index[side[0]]]
        return w * options.retrieval_weight if side[0] in favoured else w

    k_bits, v_bits = vector_bits([weight(s) for s in keys], [weight(s) for s in values],
                                 [rho[s] for s in keys], [rho[s] for s in values],
                                 code_budget(full, options), key_share, tuple_dims)
    layers = list(full.layers)
    for (layer, side), bits in [*zip(keys, k_bits), *zip(values, v_bits)]:
        i = index[layer]
        energy = (k_energy if side == "k" else v_energy)[i]
        layers[i] = _coded(layers[i], side, bits, books[layer, side], energy, tuple_dims,
                           options)
    for layer, why in favoured.items():
        if (layer, "k") not in sides and (layer, "v") not in sides:
            continue
        i = index[layer]
        why = f"weighed ×{options.retrieval_weight:g} for retrieval ({why})"
        layers[i] = replace(layers[i], note=f"{layers[i].note}; {why}" if layers[i].note else why)
    plan = replace(full, layers=layers, options=options, scheme=VECTOR)
    size = options.budget.of(plan)
    plan.reachable = (size, size)
    return plan


def vector_candidate(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                     inputs: list[LayerInput], note: str,
                     projections: ProjectionMoments | None = None) -> tuple[Plan, float]:
    """The vector plan at ``options``' budget (``options.rope`` resolved to one mode, its
    basis to the one ``inputs`` carry) and its held-out loss: its channels weighed by the
    loss's sensitivities where measurable (else the spectra's energies), with the least
    held-out loss over the keys' share of ``KEY_SHARES``, then the layers retrieval leans on
    favoured at that share (:func:`retrieval_favoured`); then the same with the retrieval
    answers' sensitivities added (:func:`weigh_answers`) where they cost at most
    ``RETRIEVAL_COST`` (``projections``: what a first calibration measured for the
    sensitivities, :func:`~lorc_fx.plan.sensitivity.calibration_with_gradients`)."""
    inputs = without_sliding_latents(inputs)
    full = plan_layers(inputs, replace(options, cache_fraction=1.0, bits_per_value=None,
                                       latent_bits=16, key_fraction=None))
    calibration = options.calibration
    tokenizer = calibration_tokenizer(model, calibration)
    windows = calibration_windows(tokenizer, calibration, model)
    books, rho, sensitivities = books_and_sensitivities(model, blocks, full, windows,
                                                        projections)

    def planned(weights: dict[Side, torch.Tensor] | None, at: PlanOptions, weighed: str
                ) -> tuple[Plan, float, float]:
        """The plan of ``at`` with ``weights`` (the keys' share chosen, retrieval's layers
        favoured), its held-out loss, and the loss before any layer was favoured."""
        measured: dict[float, tuple[float, Plan]] = {}

        def loss_at(share: float) -> float:
            plan = vector_plan(full, inputs, at, books, rho, share, weights)
            loss = held_out_loss(model, blocks, plan)
            log.info("vector codes, channels weighed by %s, keys' share %.2f: held-out loss "
                     "%.4f", weighed, share, loss)
            measured[share] = loss, plan
            return loss

        share = least_over_shares(loss_at)
        loss, plan = measured[share]

        def favouring(weight: float, favoured: dict[int, str]) -> tuple[Plan, float]:
            plan = vector_plan(full, inputs, replace(at, retrieval_weight=weight), books, rho,
                               share, weights, favoured)
            return plan, held_out_loss(model, blocks, plan)

        return *favour_retrieval(model, tokenizer, blocks, at, plan, loss, favouring), loss

    plan, loss, unfavoured = planned(sensitivities, replace(options, answer_weight=0.0),
                                     "the spectra's energies" if sensitivities is None
                                     else "the loss's sensitivities")
    answers = retrieval_answers(model, tokenizer, blocks, full, windows, options,
                                sensitivities)
    if answers is not None:
        plan, loss = weigh_answers(options, plan, loss, unfavoured, lambda weight: planned(
            with_answers(sensitivities, answers, weight), replace(options, answer_weight=weight),
            f"the loss's and ×{weight:g} the answers' sensitivities")[:2])
    plan.basis_note = note
    return plan, loss


def retrieval_answers(model: nn.Module, tokenizer, blocks: list[AttentionBlock], full: Plan,
                      windows: torch.Tensor, options: PlanOptions,
                      sensitivities: dict[Side, torch.Tensor] | None
                      ) -> dict[Side, torch.Tensor] | None:
    """The retrieval answers' sensitivities to the channels of ``full``
    (``search.answer_sensitivity``, kept on disk); none where ``options.answer_weight`` is 0,
    or where the text's could not be measured, the model has no tokenizer or too short a
    context for the prompts (said)."""
    if options.answer_weight == 0:
        return None
    length = answer_length(model)
    if sensitivities is None:
        lacks = "latents that are not linear in their projections (keys cached after RoPE)"
    elif tokenizer is None:
        lacks = "no tokenizer"
    elif length is None:
        lacks = "too short a context for the answers' prompts"
    else:
        return kept_answer_sensitivities(model, tokenizer, blocks, full, windows, length)
    log.warning("lorc_fx: vector codes weigh no channel by retrieval answers: the model has %s",
                lacks)
    return None


def weigh_answers(options: PlanOptions, plan: Plan, loss: float, unfavoured: float,
                  weighing: Callable[[float], tuple[Plan, float]]) -> tuple[Plan, float]:
    """``plan`` (of held-out ``loss``, the channels weighed by the text alone; ``unfavoured``:
    its loss before any layer was favoured for retrieval) or the plan with the retrieval
    answers' sensitivities added (``weighing(weight)``: the plan and its loss) at
    ``options.answer_weight`` times the text's total, else half or a quarter of it, whichever
    first costs at most ``RETRIEVAL_COST`` nats of held-out loss over ``unfavoured``: the
    favoured layers and the answers' weights share one cap, so that together they cost no
    more than either may; ``plan`` (its ``answer_weight`` 0), said, where all cost more. Not
    chosen by the loss: it would never pay what retrieval needs."""
    tried = [options.answer_weight / 2 ** i for i in range(3)]
    chosen = first_within_cost(tried, weighing, unfavoured, "channels also weighed by the "
                               "retrieval answers' sensitivities at ×{weight:g} the text's",
                               "over the text's weights, no layer favoured")
    if chosen is not None:
        return chosen
    log.warning("lorc_fx: vector codes weigh no channel by retrieval answers: at ×%s the "
                "text's weights they cost more than %g nats of held-out loss",
                " / ×".join(f"{w:g}" for w in tried), RETRIEVAL_COST)
    return plan, loss


def favour_retrieval(model: nn.Module, tokenizer, blocks: list[AttentionBlock],
                     options: PlanOptions, plan: Plan, loss: float,
                     favouring: Callable[[float, dict[int, str]], tuple[Plan, float]]
                     ) -> tuple[Plan, float]:
    """``plan`` (of held-out ``loss``) with the layers retrieval leans on weighed more
    (``favouring(weight, layers)``: the plan and its loss), at ``options.retrieval_weight``,
    else at its square root, whichever first costs at most ``RETRIEVAL_COST`` nats of
    held-out loss; ``plan`` itself (its ``retrieval_weight`` 1) where no layer stands out or
    both cost more. Not chosen by the loss: it would never pay what retrieval needs."""
    favoured = retrieval_favoured(model, tokenizer, blocks, options, plan)
    if favoured:
        layers = ", ".join(map(str, favoured))
        tried = (options.retrieval_weight, options.retrieval_weight ** 0.5)
        chosen = first_within_cost(tried, lambda weight: favouring(weight, favoured), loss,
                                   f"layers {layers} weighed ×{{weight:g}} for retrieval")
        if chosen is not None:
            return chosen
        log.warning("lorc_fx: vector codes favour no layer for retrieval: weighing layers %s "
                    "×%g or ×%g costs more than %g nats of held-out loss", layers, *tried,
                    RETRIEVAL_COST)
    return replace(plan, options=replace(plan.options, retrieval_weight=1.0)), loss


def first_within_cost(weights: Sequence[float], planned: Callable[[float], tuple[Plan, float]],
                      baseline: float, what: str, over: str = ""
                      ) -> tuple[Plan, float] | None:
    """The plan and held-out loss ``planned(weight)`` of the first of ``weights`` that costs
    at most ``RETRIEVAL_COST`` nats over ``baseline``, each logged (``what``: what a weight
    weighs, formatted with it; ``over``: what the baseline is); ``None`` where all cost more.
    The two retrieval levers' rule (:func:`favour_retrieval`, :func:`weigh_answers`)."""
    for weight in weights:
        plan, loss = planned(weight)
        cost = loss - baseline
        log.info("vector codes: %s: held-out loss %.4f (%+.4f%s)", what.format(weight=weight),
                 loss, cost, f" {over}" if over else "")
        if cost <= RETRIEVAL_COST:
            return plan, loss
    return None


def retrieval_favoured(model: nn.Module, tokenizer, blocks: list[AttentionBlock],
                       options: PlanOptions, plan: Plan) -> dict[int, str]:
    """The layers of ``plan`` whose codes alone move retrieval answers most
    (``search.retrieval_probe``), each with what its plan's note says of it; none where
    ``options.retrieval_weight`` is 1, or where the model has no tokenizer (``None``) or too
    short a context for the probe's prompts (said)."""
    if options.retrieval_weight == 1:
        return {}
    length = probe_length(model)
    if tokenizer is None:
        lacks = "no tokenizer"
    elif length is None:
        lacks = "too short a context for the probe's prompts"
    elif not reads_side_by_side(model):
        lacks = ("a cache of its own class, an indexer's keys, or layers holding keys and "
                 "states both, which the probe does not read side by side")
    else:
        lacks = None
    if lacks:
        log.warning("lorc_fx: vector codes favour no layer for retrieval: the model has %s",
                    lacks)
        return {}
    damage = kept_layer_damage(model, tokenizer, blocks, plan, length)
    favoured = retrieval_layers(damage)
    mean = sum(damage.values()) / len(damage) if damage else 0.0
    log.info("vector codes: layers %s move multikey answers most when coded alone (%s nats, "
             "mean %.3f)", ", ".join(map(str, favoured)) or "none",
             ", ".join(f"{damage[l]:.3f}" for l in favoured), mean)
    return {l: f"coded alone it moves multikey answers by {damage[l]:.3f} nats, the mean layer "
               f"{mean:.3f}" for l in favoured}


def least_over_shares(loss_at: Callable[[float], float]) -> float:
    """The share of ``KEY_SHARES`` with the least ``loss_at``, found by walking from the middle
    one to the neighbour that lowers the loss until the next raises it (2-4 measured, not 4):
    the loss is near unimodal in the share (bench/results/bit_waterfill-cpu.md: neighbours
    0.004-0.02 nats apart, one bump within the standard error)."""
    i = len(KEY_SHARES) // 2
    losses = {i: loss_at(KEY_SHARES[i])}
    for step in (1, -1):
        j = i + step
        while 0 <= j < len(KEY_SHARES):
            losses[j] = loss_at(KEY_SHARES[j])
            if losses[j] >= losses[j - step]:
                break
            j += step
        if j - step != i:  # the loss fell this way: the other way is not walked
            break
    return KEY_SHARES[min(losses, key=losses.get)]


VECTOR = register(Vector())
