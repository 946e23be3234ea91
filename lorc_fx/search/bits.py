"""Choose the latents' bit width by measuring the loss each candidate causes at one budget.

At a byte budget, fewer bits per latent buy more rank: 4-bit latents at 0.5 of the full
width cost about what 16-bit latents at 0.15 do. Which trade is best depends on the model
and the budget, and the error models of the rank planner do not see quantization, so the
candidates are measured: for each RoPE mode, latent bit width (16/8/4, one width for keys
and values) and group size, the calibrated rank planner fills the budget (its key/value split
measured as for any plan, ``search.split``, once per mode and width: further group sizes
reuse it), and plain KV-cache quantization (every layer full width,
identity bases, ``plan.planner.plain_quantized_plan``) is a candidate wherever it fits the
budget. Each is scored by its loss on held-out calibration windows through the real latent
cache; the least loss wins, and the plan records every candidate measured.

Plain quantization is measured first, widest first: it needs no calibration of a basis, and
where 8-bit codes fit the budget they cost nothing measurable (×1.0003 perplexity on the
default model, bench/results/kv_quant_baseline-cpu.md). A candidate whose loss is within
``NEGLIGIBLE_LOSS`` of the uncompressed model's ends the search: no other candidate can
beat it by more than that, and the low-rank candidates after it each cost a calibration and
a key/value split search (minutes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from lorc_fx.plan.bit_allocation import KEY_GROUP, KEY_WIDTHS
from lorc_fx.plan.planner import Plan
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.search.vector_bits import TUPLE_DIMS, WIDTHS

# nats per token: a held-out loss this close to the uncompressed model's is ×1.002 perplexity
# at most, below the spread between evaluation texts (bench/results/bits_pareto-cpu.md)
NEGLIGIBLE_LOSS = 0.002


def over_budget(plan: Plan) -> bool:
    """Whether ``plan`` holds more than its budget by more than one rank step (the rank
    schedules snap to the nearest step, so a plan may exceed its budget by less)."""
    o = plan.options
    full, _ = plan.cache_elements_per_token()
    _, float_bits = o.budget(plan.dtype_bits)
    step = o.rank_multiple * o.latent_bits_per_value(float_bits) / full
    if o.bits_per_value is not None:
        return plan.bits_per_value > o.bits_per_value + step + 1e-9
    return plan.cache_fraction > o.cache_fraction + step / plan.dtype_bits + 1e-9


@dataclass(frozen=True)
class Candidate:
    rope: str
    latent_bits: int
    latent_group: int = 32  # tokens per scale and zero point (no meaning at 16 bits)
    plain: bool = False  # plain KV-cache quantization: full width, identity bases
    # keys water-filled over code widths (``plan.bit_allocation``), values as plain
    # quantization's at latent_bits / latent_group
    keys_waterfilled: bool = False
    # latents at full rank as product vector codes (``search.vector_bits``), below the budget
    # of the cheapest plain quantization only
    vector: bool = False

    @property
    def name(self) -> str:
        if self.plain:
            return f"plain KV quantization, {self.latent_bits}-bit, G{self.latent_group}"
        if self.vector:
            return (f"vector codes (tuples of {TUPLE_DIMS} latent channels at "
                    f"{min(WIDTHS):g}-{max(WIDTHS):g} bits), rope=reconstruct")
        if self.keys_waterfilled:
            widths = "/".join(str(b) for b in KEY_WIDTHS)
            return (f"keys water-filled over {widths}-bit rows (G{KEY_GROUP}), values "
                    f"{self.latent_bits}-bit per token (G{self.latent_group})")
        bits = ("16-bit latents" if self.latent_bits == 16
                else f"{self.latent_bits}-bit latents, G{self.latent_group}")
        return f"low rank, {bits}, rope={self.rope}"


def candidates(modes: list[str], bit_choices: tuple[int, ...], groups: tuple[int, ...],
               plain: bool) -> list[Candidate]:
    """(``plain``) plain quantization at each width below 16, widest first, and each group
    (largest first: fewest bytes), then (``plain``, 4-bit values and the ``reconstruct`` mode
    among ``modes``) keys water-filled beside 4-bit values in the largest group, and (``plain``
    and the ``reconstruct`` mode) vector codes, planned only where no plain candidate fits
    the budget (the caller refuses it elsewhere: its first fit takes minutes); then every
    RoPE mode at every bit width (below 16 bits with every group size, the first group
    first)."""
    out = []
    if plain:
        out += [Candidate("commute", bits, group, True)
                for bits in sorted((b for b in bit_choices if b != 16), reverse=True)
                for group in sorted(groups, reverse=True)]
        if 4 in bit_choices and "reconstruct" in modes:
            out.append(Candidate("reconstruct", 4, max(groups), keys_waterfilled=True))
        if "reconstruct" in modes:
            out.append(Candidate("reconstruct", 16, groups[0], vector=True))
    return out + [Candidate(mode, bits, group) for mode in modes for bits in bit_choices
                  for group in (groups if bits != 16 else groups[:1])]


def best_candidate(build: Callable[[Candidate], tuple[Plan, float | None]],
                   listed: list[Candidate], progress: bool = True,
                   enough: float | None = None) -> tuple[Plan, float | None]:
    """The plan of the candidate with the least held-out loss, and that loss (``build`` plans
    one and measures its loss, or returns ``None`` where nothing can be measured: then the
    first that plans wins). Candidates out of reach of the budget (``UnreachableFraction``)
    or over it (``over_budget``, where there is more than one candidate) are left out; where
    none plans, the first refusal is raised. A loss at most ``enough`` ends the search. The
    plan returned records every candidate measured, best first, in ``Plan.candidates``."""
    from tqdm.auto import tqdm

    planned: list[tuple[float, Candidate, Plan]] = []
    refused: list[UnreachableFraction] = []
    bar = tqdm(listed, desc="measuring plan candidates", unit="candidate",
               disable=not progress or len(listed) < 2)
    for candidate in bar:
        bar.set_postfix_str(candidate.name)
        try:
            plan, loss = build(candidate)
        except UnreachableFraction as err:
            refused.append(err)
            continue
        if len(listed) > 1 and over_budget(plan):  # compared at equal bytes only
            refused.append(UnreachableFraction(f"{candidate.name} is over the budget", math.inf))
            continue
        if loss is None:  # nothing to compare on: the first candidate that plans
            bar.close()
            return plan, None
        planned.append((loss, candidate, plan))
        if enough is not None and loss <= enough:
            bar.set_postfix_str(f"{candidate.name}: within noise of the full cache, search ends")
            break
    bar.close()
    if not planned:
        raise refused[0]
    planned.sort(key=lambda p: p[0])
    best = planned[0][2]
    if len(listed) > 1:
        best.candidates = [{"candidate": c.name, "rope": c.rope, "latent_bits": c.latent_bits,
                            "latent_group": c.latent_group, "plain": c.plain,
                            "keys_waterfilled": c.keys_waterfilled, "vector": c.vector,
                            "loss": None if math.isinf(loss) else loss,
                            "bits_per_value": p.bits_per_value,
                            "cache_fraction": p.cache_fraction} for loss, c, p in planned]
    return best, planned[0][0]
