"""Plain KV quantization: the keys (after any norm and RoPE) and values themselves stored as
8- or 4-bit codes, keys per channel over groups of G tokens and values per token over groups
of channels within each head (KIVI's layout), 16-bit scales and zero points; no basis.

The search measures it first, widest first (``planner.plain_quantized_plan``): it needs no
calibration of a basis, and where 8-bit codes fit the budget they cost nothing measurable
(×1.0003 perplexity on the default model, bench/results/kv_quant_baseline-cpu.md), so a
candidate within noise of the full cache ends the search. Splitting the KV heads over
tensor-parallel processes changes nothing: each quantizes its own heads' keys and values,
grouped exactly as on one process.

It needs no proof from the graph either: it only changes what a cache layer stores, so where
the analysis declines a block or a whole model (MLA, a forward dynamo cannot trace, custom
attention), ``plan_without_graph`` codes what transformers' cache holds for it. Nothing is
measured there (the graph that a candidate's loss and the other schemes need is what was
declined): the widest code that fits the budget is chosen, 8-bit G64 first.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

from lorc_fx.codes.rows import RowSpec
from lorc_fx.plan.options import AUTO, PlanOptions
from lorc_fx.plan.planner import LayerInput, Plan, plain_quantized_plan
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
        inputs = sorted(search.layer_inputs() + search.declined_inputs(), key=lambda l: l.layer)
        plan = plain_quantized_plan(inputs, search.candidate_options("commute", bits, group),
                                    search.layer_inputs()[0].dtype_bits)
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
        rows = [l for l in plan.layers if isinstance(l.k_code, RowSpec)]
        kv = len(plan.layers) - kept - len(rows)
        chosen = ([f"chosen by bits alone, nothing measured: {plan.unproven}"]
                  if plan.unproven else [])
        stored = []
        if kv:
            stored.append(("keys (after RoPE) and values" if not rows else
                           f"keys (after RoPE) and values of {kv} layers")
                          + f" stored as {o.latent_bits}-bit "
                          f"codes, keys per channel over groups of {o.latent_group} tokens, "
                          "values per token over groups of channels within each head (the last "
                          "partial group of tokens in full precision)")
        if rows:
            stored.append(f"{len(rows)} cache layers of the model's own classes with every "
                          f"state they hold as {o.latent_bits}-bit rows, a power-of-two scale "
                          "per group (their layers' lines)")
        return [f"plain KV quantization of {len(plan.layers) - kept} attention layers"
                + (f" ({kept} kept as transformers builds them)" if kept else "")
                + f", no low rank: {'; '.join(stored)}"] + chosen


register(Plain())

# what a plan without the graph tries, in order: the widest code first, then fewest bytes
NO_GRAPH_WIDTHS, NO_GRAPH_GROUPS = (8, 4), (64, 32)


class NoGraphPlan(ValueError):
    """The options ask for what only the graph's proof gives (low rank, a measured target, the
    whole cache exact): a declined model is left as it is."""


def plan_without_graph(inputs: list[LayerInput], options: PlanOptions, dtype_bits: int,
                       why: str) -> Plan:
    """The plain plan of layers the analysis declined (``inputs``: what their cache holds,
    ``planner.cache_layer_input``; ``why``: the analysis's words) for ``options``' budget,
    chosen by bits alone, as nothing can be measured: the widest of ``NO_GRAPH_WIDTHS`` (or
    ``latent_bits`` where given) at the largest group (or ``latent_group``) that fits.
    Raises ``UnreachableFraction`` (the least such a plan reaches) where none fits, and
    :class:`NoGraphPlan` where the options ask for what needs the graph."""
    if options.latent_bits == 16:
        raise NoGraphPlan(f"latent_bits=16 asks for low rank, which needs the graph: {why}")
    if options.max_ppl_increase is not None:
        raise NoGraphPlan(f"max_ppl_increase measures candidates, which needs the graph: {why}")
    if options.budget.whole:
        raise NoGraphPlan(f"{options.budget} keeps the whole cache: {why}")
    widths = NO_GRAPH_WIDTHS if options.latent_bits == AUTO else (options.latent_bits,)
    groups = NO_GRAPH_GROUPS if options.latent_group is None else (options.latent_group,)
    least = None
    for bits in widths:
        for group in groups:
            plan = plain_quantized_plan(
                inputs, replace(options, latent_bits=bits, latent_group=group), dtype_bits)
            if not over_budget(plan):
                plan.unproven = (f"the analysis declined the attention ({why}), so plain "
                                 f"{bits}-bit codes, the widest that fit the budget, store "
                                 "what transformers' cache holds")
                return plan
            size = plan.budget.of(plan)
            least = size if least is None else min(least, size)
    budget = options.budget
    raise UnreachableFraction(
        f"{budget} is out of reach: the analysis declined this model's attention ({why}), so "
        f"only plain codes store its cache, which reach [{least:.3f}, {budget.top:g}] "
        f"({budget.unit})", least)
