"""Plain KV quantization: the keys (after any norm and RoPE) and values themselves stored as
8- or 4-bit codes, keys per channel over groups of G tokens and values per token over groups
of channels within each head (KIVI's layout), 16-bit scales and zero points; no basis.

The search measures it first, widest first (``planner.plain_quantized_plan``): it needs no
calibration of a basis, and where 8-bit codes fit the budget they cost nothing measurable
(×1.0003 perplexity on the default model, bench/results/kv_quant_baseline-cpu.md), so a
candidate within noise of the full cache ends the search. Splitting the KV heads over
tensor-parallel processes changes nothing: each quantizes its own heads' keys and values,
grouped exactly as on one process.
"""
from __future__ import annotations

from functools import partial

from lorc_fx.plan.planner import Plan, plain_quantized_plan
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.plan.scheme import PLAIN, Capabilities, Scheme, register
from lorc_fx.search.candidates import over_budget
from lorc_fx.search.context import Candidate, SearchContext
from lorc_fx.search.split import held_out_loss


class Plain(Scheme):
    name = PLAIN
    title = "plain KV quantization"
    capabilities = Capabilities(static_cache=True, compiled_decode=True, shards=True)
    identity_bases = True

    def candidates(self, search: SearchContext) -> list[Candidate]:
        """Each width below 16 (widest first) at each group (largest first: fewest bytes),
        where the storage is searched."""
        if not search.searched:
            return []
        return [Candidate(f"plain KV quantization, {bits}-bit, G{group}", self.name,
                          partial(self._build, search, bits, group), "commute", bits, group)
                for bits in sorted((b for b in search.widths if b != 16), reverse=True)
                for group in sorted(search.groups, reverse=True)]

    def _build(self, search: SearchContext, bits: int, group: int) -> tuple[Plan, float | None]:
        plan = plain_quantized_plan(search.layer_inputs(),
                                    search.candidate_options("commute", bits, group))
        if over_budget(plan):  # said before measuring what would be left out anyway
            budget = plan.budget
            raise UnreachableFraction(f"plain KV quantization, {bits}-bit, G{group} is over "
                                      f"the budget: it stores {budget.of(plan):.3f} "
                                      f"({budget.unit})", budget.of(plan))
        return plan, held_out_loss(search.model, search.blocks, plan) if search.measure else None

    def how(self, plan: Plan) -> str:
        return "plain KV quantization, no basis"

    def summary(self, plan: Plan) -> str:
        return f"plain int{plan.options.latent_bits} G{plan.options.latent_group}"

    def describe(self, plan: Plan) -> list[str]:
        o = plan.options
        kept = sum(l.skipped for l in plan.layers)
        return [f"plain KV quantization of {len(plan.layers) - kept} attention layers"
                + (f" ({kept} kept as transformers builds them)" if kept else "")
                + f", no low rank: keys (after RoPE) and values stored as {o.latent_bits}-bit "
                f"codes, keys per channel over groups of {o.latent_group} tokens, values per "
                "token over groups of channels within each head (the last partial group of "
                "tokens in full precision)"]


register(Plain())
