"""Low rank (LoRC, the paper's method): each layer's keys and values cached as latents of a
basis, the rank per layer filling the budget (``planner.plan_layers``, the rank schedules),
latents stored in the model's dtype or as 8- or 4-bit codes per channel over groups of G
tokens; keys after RoPE (``commute``: absorbed at decode) or before it (``reconstruct``: the
angle log kept, keys rebuilt every step).

The search offers every RoPE mode at every latent width and group, narrowest width first;
with a calibrated basis and the calibrated schedule each measures its key/value split
(``search.split``), once per mode and width (further group sizes reuse it). At one budget a
wider latent buys finer codes with fewer ranks; where the loss rose from one width to the
next of a mode, a wider width still is not measured (``Candidate.skipped``): on the default
model the loss rose from 4- to 8- to 16-bit latents in every mode at every budget from 1.92
to 4.5 bits per value, by 0.13 nats or more a step (bench/results/bits_pareto-cpu.md), and
each width's split search took ~40 s at one thread.

Where vector codes planned at the budget (below what plain quantization fits), no low-rank
candidate is measured (``Candidate.skipped``): vector codes give each latent channel of the
same calibrated basis, keys before RoPE, 0.5 to 6 bits or drop it, so their allocation spans
``reconstruct``'s ranks and 4-bit widths with no scales to store, and ``commute`` is low rank
over a basis constrained to turn with RoPE, which keeps no more at a rank. On the default
model they beat every low-rank candidate by 0.08, 0.15 and 0.31 nats at 3, 2.56 and 1.92
bits per value (bench/results/bits_pareto-cpu.md), and skipping them takes ~4.5 minutes (two
split searches and eight held-out losses) off the 12 of a first 2.56-bit plan there on 2
threads.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import LayerInput, Plan, plan_layers
from lorc_fx.plan.scheme import LOW_RANK, Capabilities, Scheme, rank_table, register
from lorc_fx.schemes.vector import VECTOR
from lorc_fx.search.context import CALIBRATED_BASES, Candidate, SearchContext
from lorc_fx.search.split import held_out_loss, measured_split
from torch import nn


class LowRank(Scheme):
    name = LOW_RANK
    title = "low rank"
    capabilities = Capabilities(static_cache=True, compiled_decode=True, shards=True)

    def candidates(self, search: SearchContext) -> list[Candidate]:
        """Every RoPE mode at every latent width, narrowest first (below 16 bits at every
        group, the first group first)."""
        return [Candidate(self._name(mode, bits, group), self.name,
                          partial(self._build, search, mode, bits, group), mode, bits, group,
                          partial(_skipped, search, mode, bits))
                for mode in search.modes for bits in sorted(search.widths)
                for group in (search.groups if bits != 16 else search.groups[:1])]

    @staticmethod
    def _name(rope: str, bits: int, group: int) -> str:
        stored = "16-bit latents" if bits == 16 else f"{bits}-bit latents, G{group}"
        return f"low rank, {stored}, rope={rope}"

    def _build(self, search: SearchContext, rope: str, bits: int, group: int
               ) -> tuple[Plan, float | None]:
        resolved, inputs, note = search.prepared(rope)
        # RoPE modes are compared where the basis is calibrated; bit widths always
        measured = search.measure and (resolved.basis in CALIBRATED_BASES or search.searched)
        asked = replace(resolved, latent_bits=bits, latent_group=group,
                        key_fraction=search.splits.get((rope, bits), resolved.key_fraction))
        plan, loss = planned(search.model, search.blocks, asked, inputs, note, measured)
        if len(search.groups) > 1:
            search.splits.setdefault((rope, bits), plan.options.key_fraction)
        if loss is not None:
            least = search.width_losses.get((rope, bits), loss)
            search.width_losses[rope, bits] = min(least, loss)
        return plan, loss

    def how(self, plan: Plan) -> str:
        o, (lo, hi) = plan.options, plan.reachable
        return f"{o.schedule} schedule reaches [{lo:.3f}, {hi:.3f}]; basis={o.basis}, rope={o.rope}"

    def summary(self, plan: Plan) -> str:
        o = plan.options
        full, kept = plan.cache_elements_per_token()
        group = f" G{o.latent_group}" if o.latent_bits != 16 else ""
        return (f"low rank ({kept / full:.2f} of the width), {o.latent_bits}-bit latents{group}, "
                f"{o.rope}")

    def describe(self, plan: Plan) -> list[str]:
        o = plan.options
        lines = rank_table(plan)
        if o.latent_bits != 16:
            lines.append(f"latents stored as {o.latent_bits}-bit codes, per channel over groups "
                         f"of {o.latent_group} tokens (the last partial group in full precision)")
        return lines


def _skipped(search: SearchContext, rope: str, bits: int) -> str | None:
    """Why the candidate of mode ``rope`` at ``bits`` need not be measured: a vector-coded
    plan was measured at this budget (the module's docstring says why it covers low rank), or
    the two narrower widths measured in mode ``rope`` lost more at the wider of them."""
    loss = search.scheme_losses.get(VECTOR.name)
    if loss is not None:
        return (f"vector codes planned at this budget (held-out loss {loss:.4f}), and their "
                "allocation covers low rank's ranks and widths in the same basis")
    narrower = sorted(w for w in search.widths if w < bits)[-2:]
    losses = [search.width_losses.get((rope, w)) for w in narrower]
    if len(narrower) == 2 and None not in losses and losses[1] > losses[0]:
        return (f"{narrower[1]}-bit latents lost {losses[1]:.4f} nats against {narrower[0]}-bit "
                f"ones' {losses[0]:.4f} (a wider latent buys fewer ranks)")
    return None


def planned(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
            inputs: list[LayerInput], note: str, measure: bool) -> tuple[Plan, float | None]:
    """The low-rank plan of ``options`` (their RoPE mode and latent bits) and, where
    ``measure`` asks (or the split search measures anyway), its held-out calibration loss."""
    loss = None
    if options.basis in CALIBRATED_BASES and options.schedule == "calibrated" \
            and options.key_fraction is None:
        key_fraction, loss = measured_split(model, blocks, inputs, options)
        options = replace(options, key_fraction=key_fraction)
    plan = plan_layers(inputs, options)
    plan.basis_note = note
    if loss is None and measure:
        loss = held_out_loss(model, blocks, plan)
    return plan, loss


register(LowRank())
