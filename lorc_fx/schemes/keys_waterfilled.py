"""Keys water-filled over code widths: keys cached before RoPE as latents of the planner's
basis at full rank, each latent row at the width its energy and measured rounding error buy
(8, 4 or 3 bits, or dropped), beside plain quantization's 4-bit values.

A key latent's rows are a data-aware basis, most energy first, so storing every row at one
width (and cutting the rank to the budget) spends bits where they buy little. Transform
coding's answer is to give each row the width its share of the error buys (dropping a row is
the 0-bit case). Row ``c`` at width ``b`` is modelled to cost ``e_c·ρ_c(b)``: ``e_c`` its
spectrum energy (the error of dropping it, in the planner's one unit across layers),
``ρ_c(b)`` its relative squared rounding error, ``ρ_c(0) = 1``. A row's rounding error at a
width depends on how its values spread within a group of tokens (outlier tokens widen the
range every code shares), which no weight spectrum says; so the calibration windows run
through the latent cache of the full-rank plan once, and each layer's cached key latent is
quantized at every width of ``KEY_WIDTHS`` to measure it. Stored per channel over groups of
``KEY_GROUP`` tokens a row costs ``b + 2·16/G`` bits a token (codes, 16-bit scale and zero
point); ``plan.bit_allocation.allocate`` (greedy descent on each row's lower convex hull, all
rows of all layers together) spends the keys' budget where the error falls fastest.

Values stay KIVI's (per token, ``latent_bits`` bits in groups of ``latent_group`` channels of
a head; identity basis), as measured best at 4.5 bits per value on the planner's held-out
windows (docs/schemes/keys_waterfilled.md): keys over widths 3/4/8 in groups of 256 tokens
beside 4-bit values.

Measured only where the budget leaves the key rows on average at least what the narrowest
row stores (3 bits and its scales): below that the water-filling drops most rows, where
vector codes (``schemes.vector``) keep them at 0.5-2 bits; on the default model water-filled
keys lost 0.14 nats of held-out loss to vector codes at 3 bits per value and 0.51 at 2.56
(bench/results/bits_pareto-cpu.md), and measuring them cost a first plan ~20 s.

Invariants of the plan: each layer's key basis holds the rows it keeps, reordered into runs of
one width, widest first (its ``k_code``, a ``ChannelSplit``); its bytes are the budget's or
fewer; no compressed layer drops every key row.
"""
from __future__ import annotations

import math
from dataclasses import replace
from itertools import groupby

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.codes.integer import ChannelSplit, QuantSpec, fake_quantize
from lorc_fx.plan.bit_allocation import allocate
from lorc_fx.plan.calibration import calibration_tokenizer, calibration_windows
from lorc_fx.plan.options import SCALE_BITS, PlanOptions
from lorc_fx.plan.planner import (LayerInput, LayerPlan, Plan, key_energies, plan_layers,
                                  scale_dtype, value_token_group)
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.plan.scheme import Capabilities, Scheme, rank_table, register
from lorc_fx.search.context import Candidate, SearchContext, Skipped
from lorc_fx.search.split import held_out_loss
from lorc_fx.search.windows import through_cache

KEY_WIDTHS = (3, 4, 8)  # code widths a key row may take (besides dropped)
KEY_GROUP = 256  # tokens per scale and zero point of a key row
VALUE_BITS = 4  # the values' plain quantization
ERROR_TOKENS = 4096  # calibration tokens the rounding errors are measured on


class KeysWaterfilled(Scheme):
    name = "keys_waterfilled"
    title = "keys water-filled over code widths"
    capabilities = Capabilities(static_cache=True, compiled_decode=True, shards=False)

    def candidates(self, search: SearchContext) -> list[Candidate]:
        """One, where the storage is searched at 4 bits and keys may be cached before RoPE:
        the values' group the largest searched."""
        if not (search.searched and VALUE_BITS in search.widths and "reconstruct" in search.modes):
            return []
        group = max(search.groups)
        widths = "/".join(str(b) for b in KEY_WIDTHS)
        name = (f"keys water-filled over {widths}-bit rows (G{KEY_GROUP}), values "
                f"{VALUE_BITS}-bit per token (G{group})")
        return [Candidate(name, self.name, lambda: self._build(search, group), "reconstruct",
                          VALUE_BITS, group)]

    def _build(self, search: SearchContext, group: int) -> tuple[Plan, float | None]:
        if search.options.shards > 1:
            raise UnreachableFraction("keys water-filled: not planned over shards", math.inf)
        options = replace(search.options, rope="reconstruct", latent_bits=VALUE_BITS,
                          latent_group=group)
        # before the bases' calibration (which vector codes, planned where this is skipped,
        # run with their sensitivities): a full-rank plan's layout needs only the weights
        _check_key_rows(_full_rank(search.layer_inputs(), replace(options, basis="weight")),
                        options)
        resolved, inputs, note = search.prepared("reconstruct")
        plan = waterfilled_candidate(search.model, search.blocks,
                                     replace(resolved, latent_bits=VALUE_BITS, latent_group=group),
                                     inputs, note)
        return plan, held_out_loss(search.model, search.blocks, plan) if search.measure else None

    def how(self, plan: Plan) -> str:
        o = plan.options
        return f"keys water-filled over code widths; basis={o.basis}, rope={o.rope}"

    def summary(self, plan: Plan) -> str:
        o, rows = plan.options, key_rows_per_width(plan)
        keys = " / ".join(f"{rows[b]}×{b}" for b in sorted(rows, reverse=True))
        group = next(l.k_code.group for l in plan.layers if isinstance(l.k_code, ChannelSplit))
        return (f"keys water-filled ({keys}-bit rows of {sum(l.k_full for l in plan.layers)}, "
                f"G{group}), int{o.latent_bits} values G{o.latent_group}, {o.rope}")

    def describe(self, plan: Plan) -> list[str]:
        runs = lambda l: l.k_code.parts if isinstance(l.k_code, ChannelSplit) else ()
        lines = rank_table(plan, lambda l: "  key rows " + " ".join(f"{n}×{b}b" for n, b in runs(l))
                           if runs(l) else "")
        rows = key_rows_per_width(plan)
        full = sum(l.k_full for l in plan.layers if runs(l))
        widths = ", ".join(f"{rows[b]} at {b} bits" for b in sorted(rows, reverse=True))
        groups = sorted({l.k_code.group for l in plan.layers if runs(l)})
        lines.append(
            f"keys water-filled: each key latent row stored at the width its energy and measured "
            f"rounding error buy, or dropped ({sum(rows.values())} of {full} rows kept: "
            f"{widths}), per channel over groups of {'/'.join(map(str, groups))} tokens; values "
            f"stored as {plan.options.latent_bits}-bit codes per token over groups of channels "
            "within each head, as plain KV quantization (the last partial group of tokens in "
            "full precision)")
        return lines


def key_rows_per_width(plan: Plan) -> dict[int, int]:
    """Key latent rows stored at each code width, all layers."""
    rows: dict[int, int] = {}
    for layer in plan.layers:
        if isinstance(layer.k_code, ChannelSplit):
            for count, bits in layer.k_code.parts:
                rows[bits] = rows.get(bits, 0) + count
    return rows


@torch.no_grad()
def rounding_errors(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                    windows: torch.Tensor, widths: tuple[int, ...] = KEY_WIDTHS,
                    group: int = KEY_GROUP) -> list[dict[int, torch.Tensor]]:
    """Per layer of ``full`` (a full-rank, unquantized plan), per width of ``widths``, each
    key latent row's squared rounding error over its squared values (per channel, groups of
    ``group`` tokens) on ``windows``; an empty dict for a layer without key latents."""
    scales = scale_dtype(full.dtype_bits) or next(model.parameters()).dtype
    power: dict[int, torch.Tensor] = {}
    error: dict[tuple[int, int], torch.Tensor] = {}
    for _, _, cache in through_cache(model, blocks, full, windows):
        for l in full.layers:
            if l.skipped or not l.k_compressible:
                continue
            latent, _ = cache.layers[l.layer].latents()  # (b, 1, n, r): unquantized, full rank
            z = latent.double()
            power[l.layer] = power.get(l.layer, 0) + (z ** 2).sum((0, 1, 2))
            for bits in widths:
                spec = QuantSpec.per_channel(bits, group, scales)
                err = fake_quantize(latent, spec)[0].double() - z
                error[l.layer, bits] = error.get((l.layer, bits), 0) + (err ** 2).sum((0, 1, 2))
    return [{bits: (error[l.layer, bits] / power[l.layer].clamp_min(1e-30)).cpu()
             for bits in widths} if l.layer in power else {} for l in full.layers]


def waterfilled_candidate(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                          inputs: list[LayerInput], note: str) -> Plan:
    """The plan at ``options``' budget (``options.rope`` resolved to ``reconstruct``, its
    basis to the one ``inputs`` carry; values at ``latent_bits`` per token in groups of
    ``latent_group``), the rounding errors measured on ``ERROR_TOKENS`` calibration tokens."""
    full = _full_rank(inputs, options)
    _check_key_rows(full, options)
    calibration = options.calibration
    windows = calibration_windows(calibration_tokenizer(model, calibration), calibration, model)
    windows = windows[:max(1, ERROR_TOKENS // windows.shape[1])]
    rho = rounding_errors(model, blocks, full, windows)
    plan = waterfilled_plan(full, key_energies(inputs, options), rho, options)
    plan.basis_note = note
    return plan


def _full_rank(inputs: list[LayerInput], options: PlanOptions) -> Plan:
    """The full-rank, unquantized plan the water-filling starts from."""
    return plan_layers(inputs, replace(options, cache_fraction=1.0, bits_per_value=None,
                                       latent_bits=16, key_fraction=None))


def _check_key_rows(full: Plan, options: PlanOptions) -> None:
    """Refuse a budget the values fill; skip one that leaves the key rows of ``full`` fewer
    bits a token on average than the narrowest row stores."""
    rows = sum(l.k_full for l in full.layers if not l.skipped and l.k_compressible)
    narrowest = min(KEY_WIDTHS) + 2 * SCALE_BITS / KEY_GROUP
    keys = key_bits(full, options)
    if rows and keys <= 0:
        raise _values_fill_the_budget()
    if 0 < keys < narrowest * rows:
        raise Skipped(f"the budget leaves each key row {keys / rows:.2f} "
                      f"bits a token on average, less than the narrowest row stores "
                      f"({narrowest:g}): most rows would be dropped, where vector codes keep "
                      "them at 0.5-2 bits (measured on the default model: water-filled keys "
                      "lost 0.14 nats to vector codes at 3 bits per value, 0.51 at 2.56)")


def _keys(layer: LayerPlan, bits: list[int], energy: torch.Tensor, group: int,
          scales: torch.dtype | None) -> LayerPlan:
    """``layer`` keeping its key rows of nonzero ``bits``, widest first."""
    order = sorted((c for c, b in enumerate(bits) if b), key=lambda c: -bits[c])
    runs = tuple((len(list(rows)), b) for b, rows in groupby(bits[c] for c in order))
    index = torch.tensor(order, dtype=torch.long)
    total = float(energy.sum())
    return replace(layer, k_rank=len(order), k_basis=layer.k_basis[index],
                   k_rebuild=layer.k_rebuild[index], k_code=ChannelSplit(runs, group, scales),
                   k_energy_kept=float(energy[index].sum()) / total if total > 0 else 1.0)


def _plain_values(layer: LayerPlan, options: PlanOptions, scales: torch.dtype | None
                  ) -> LayerPlan:
    """``layer`` caching its values themselves (an identity basis) as plain quantization."""
    eye = torch.eye(layer.v_full, dtype=torch.float64)
    code = QuantSpec.per_token(options.latent_bits,
                               value_token_group(layer.head_dim, options.latent_group), scales)
    return replace(layer, v_rank=layer.v_full, v_basis=eye, v_rebuild=eye, v_energy_kept=1.0,
                   v_code=code)


def _values_fill_the_budget() -> UnreachableFraction:
    return UnreachableFraction("keys water-filled beside quantized values: the values alone "
                               "fill the budget", 0.0)


def key_bits(full: Plan, options: PlanOptions) -> float:
    """Bits a token the budget of ``options`` leaves the key codes of ``full`` (a full-rank
    plan) beside everything else: values at ``latent_bits`` with their scales, what is kept
    in full precision, the RoPE angle log."""
    budget, float_bits = options.budget.bits(full.dtype_bits)
    values_per_token, _ = full.cache_elements_per_token()
    fixed = full.rotary_log * float_bits
    for l in full.layers:
        fixed += l.k_full * float_bits if l.skipped or not l.k_compressible else 0
        value_bits = options.latent_bits + 2 * SCALE_BITS / value_token_group(
            l.head_dim, options.latent_group)
        fixed += l.v_full * (float_bits if l.skipped or not l.v_compressible else value_bits)
    return budget * values_per_token - fixed


def waterfilled_plan(full: Plan, energies: list[torch.Tensor],
                     rho: list[dict[int, torch.Tensor]], options: PlanOptions,
                     widths: tuple[int, ...] = KEY_WIDTHS, group: int = KEY_GROUP) -> Plan:
    """The plan at ``options``' budget from ``full``, a full-rank plan (keys before RoPE
    where the model has RoPE; its layers' key rows in the order of ``energies``), and the
    rows' rounding errors ``rho`` (per layer of ``full``, per width of ``widths``, per row)
    in groups of ``group`` tokens."""
    if options.latent_bits == 16:
        raise ValueError("keys water-filled beside quantized values need latent_bits 8 or 4")
    picked = [i for i, l in enumerate(full.layers) if not l.skipped and l.k_compressible]
    if not picked:
        raise UnreachableFraction("keys water-filled: no layer caches key latents (keys behind "
                                  "a norm or layers kept full)", 0.0)
    keys = key_bits(full, options)
    if keys <= 0:
        raise _values_fill_the_budget()
    bits = allocate([energies[i] for i in picked], [rho[i] for i in picked], keys, widths,
                    group)
    scales = scale_dtype(full.dtype_bits)
    layers = [l if l.skipped or not l.v_compressible else _plain_values(l, options, scales)
              for l in full.layers]
    for i, b in zip(picked, bits):
        if not any(b):
            raise UnreachableFraction(f"keys water-filled: the budget leaves layer "
                                      f"{layers[i].layer} no key row", 0.0)
        layers[i] = _keys(layers[i], b, energies[i], group, scales)
    plan = replace(full, layers=layers, options=options, scheme=WATERFILLED)
    size = options.budget.of(plan)
    plan.reachable = (size, options.budget.top)
    return plan


WATERFILLED = register(KeysWaterfilled())
