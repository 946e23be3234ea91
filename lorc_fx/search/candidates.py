"""Choose how the cache is stored by measuring the loss each candidate causes at one budget.

At a byte budget, fewer bits per latent buy more rank: 4-bit latents at 0.5 of the full
width cost about what 16-bit latents at 0.15 do. Which trade is best depends on the model
and the budget, and the error models of the rank planner do not see quantization, so the
candidates are measured: every registered storage scheme (``lorc_fx.schemes``) offers its
candidates for the budget (plain KV-cache quantization at each width and group, keys
water-filled, vector codes, and for each RoPE mode, latent bit width and group size the
calibrated rank planner filling the budget). Each is scored by its loss on held-out
calibration windows through the real latent cache; the least loss wins, and the plan
records every candidate measured.

Plain quantization is measured first, widest first: it needs no calibration of a basis, and
where 8-bit codes fit the budget they cost nothing measurable (×1.0003 perplexity on the
default model, bench/results/kv_quant_baseline-cpu.md). A candidate whose loss is within
``NEGLIGIBLE_LOSS`` of the uncompressed model's ends the search: no other candidate can
beat it by more than that, and the low-rank candidates after it each cost a calibration and
a key/value split search (minutes).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

from lorc_fx.plan.options import Budget
from lorc_fx.plan.planner import Plan, plain_quantized_plan
from lorc_fx.plan.scheme import SCHEMES
from lorc_fx.plan.schedules import UnreachableFraction

from .context import Candidate, SearchContext, Skipped

# nats per token: a held-out loss this close to the uncompressed model's is ×1.002 perplexity
# at most, below the spread between evaluation texts (bench/results/bits_pareto-cpu.md)
NEGLIGIBLE_LOSS = 0.002

log = logging.getLogger(__name__)


def over_budget(plan: Plan) -> bool:
    """Whether ``plan`` holds more than its budget by more than one rank step (the rank
    schedules snap to the nearest step, so a plan may exceed its budget by less)."""
    o, budget = plan.options, plan.budget
    full, _ = plan.cache_elements_per_token()
    _, float_bits = budget.bits(plan.dtype_bits)
    step = o.rank_multiple * o.latent_bits_per_value(float_bits) / full
    return budget.of(plan) > budget.value + budget.of_bits(step, plan.dtype_bits) + 1e-9


def plain_fits(search: SearchContext, bits: int) -> bool:
    """Whether plain quantization at ``bits`` fits ``search``'s budget, in the largest group
    searched (its fewest bytes)."""
    options = search.candidate_options("commute", bits, max(search.groups))
    return not over_budget(plain_quantized_plan(search.layer_inputs(), options))


def candidates(search: SearchContext) -> list[Candidate]:
    """Every registered scheme's candidates for ``search``, in the order the schemes were
    registered (plain quantization first: it needs no calibration)."""
    return [c for scheme in SCHEMES.values() for c in scheme.candidates(search)]


def best_candidate(listed: list[Candidate], progress: bool = True,
                   enough: Callable[[], float] | None = None, budget: Budget | None = None,
                   scheme_losses: dict[str, float] | None = None
                   ) -> tuple[Plan, float | None]:
    """The plan of the candidate with the least held-out loss, and that loss (each
    ``Candidate.build`` plans one and measures its loss, or returns ``None`` where nothing can
    be measured: then the first that plans wins). Candidates out of reach of the budget
    (``UnreachableFraction``) or over it (``over_budget``, where there is more than one
    candidate) are left out; where none plans, the refusal is raised (where there were
    several, one naming the ``budget``, the least any candidate reaches and that candidate's
    refusal, else why each was refused). A loss at most ``enough()`` ends the search before
    the next candidate is built (asked there, and only there: it may cost a measurement); a
    candidate ``skipped`` or whose build raises ``Skipped`` is recorded after them with the
    reason. Each scheme's least loss so far is kept in ``scheme_losses`` (the later
    candidates read it: ``SearchContext.scheme_losses``). The plan returned records every
    candidate measured, best first, in ``Plan.candidates``."""
    from tqdm.auto import tqdm

    planned: list[tuple[float, Candidate, Plan]] = []
    refused: list[UnreachableFraction] = []
    skipped: list[tuple[Candidate, str]] = []
    bar = tqdm(listed, desc="measuring plan candidates", unit="candidate",
               disable=not progress or len(listed) < 2)
    for candidate in bar:
        try:
            why = candidate.skipped()
            if why is not None:
                raise Skipped(why)
            if planned and enough is not None:
                best = min(planned, key=lambda p: p[0])
                bar.set_postfix_str(f"{best[1].name} against the uncompressed model")
                if best[0] <= enough():
                    bar.set_postfix_str(f"{best[1].name}: within noise of the full cache, "
                                        "search ends")
                    break
            bar.set_postfix_str(candidate.name)
            plan, loss = candidate.build()
        except UnreachableFraction as err:
            refused.append(err)
            continue
        except Skipped as why:
            log.info("lorc_fx: %s not measured: %s", candidate.name, why)
            skipped.append((candidate, str(why)))
            continue
        if len(listed) > 1 and over_budget(plan):  # compared at equal bytes only
            size = plan.budget.of(plan)
            refused.append(UnreachableFraction(
                f"{candidate.name} is over the budget: it stores {size:.3f} "
                f"({plan.budget.unit})", size))
            continue
        if loss is None:  # nothing to compare on: the first candidate that plans
            bar.close()
            return plan, None
        planned.append((loss, candidate, plan))
        if scheme_losses is not None:
            scheme_losses[candidate.scheme] = min(loss, scheme_losses.get(candidate.scheme, loss))
    bar.close()
    if not planned:
        raise refused[0] if len(refused) == 1 or budget is None else _out_of_reach(refused,
                                                                                   budget)
    planned.sort(key=lambda p: p[0])
    best = planned[0][2]
    if len(listed) > 1:
        best.candidates = [{**_named(c), "loss": None if math.isinf(loss) else loss,
                            "bits_per_value": p.bits_per_value,
                            "cache_fraction": p.cache_fraction} for loss, c, p in planned] \
            + [{**_named(c), "skipped": why} for c, why in skipped]
    return best, planned[0][0]


def _named(c: Candidate) -> dict:
    return {"candidate": c.name, "scheme": c.scheme, "rope": c.rope,
            "latent_bits": c.latent_bits, "latent_group": c.latent_group}


def _out_of_reach(refused: list[UnreachableFraction], budget: Budget) -> UnreachableFraction:
    """One refusal for a budget no candidate plans: the least any candidate reaches (a
    refusal's ``lowest``, where it says one) and its refusal, else why each was refused."""
    reaching = [r for r in refused if 0 < r.lowest < math.inf]
    if not reaching:
        return UnreachableFraction(f"{budget} is out of reach on this model: no candidate plans "
                                   "on it (" + "; ".join(dict.fromkeys(map(str, refused))) + ")",
                                   math.inf)
    least = min(reaching, key=lambda r: r.lowest)
    option = "bits_per_value" if budget.in_bits else "cache_fraction"
    return UnreachableFraction(
        f"{budget} is out of reach on this model: the candidates reach [{least.lowest:.3f}, "
        f"{budget.top:g}] ({budget.unit}); ask for {option} in that range (the least: {least})",
        least.lowest)
