"""Which positions' codes cost a plan's retrieval answers: the answer teacher-forced through
the plan's cache, some positions read exact.

    python bench/retrieval_positions.py --plan PLAN [--task multikey] [--length 4k]
        [--trials 50] [--seed 11] [--prompts I,J,...] [--shard K/N] [--merge A.json,...]
        [--out PREFIX]

For each prompt the full cache reads the answer's tokens after the prompt (teacher-forced, one
token a step), then a vector-coded plan's cache does (`generate`'s dynamic cache, written by
one prefill of all but the prompt's last token, which attends them as computed). Each answer
token's margin is its log-probability less the best other token's; a cache *answers* a prompt
where every margin is positive (greedy writes the answer). On the prompts the full cache
answers and the plan, read as coded, loses, the plan's cache is read again in each of
``MODES``: the latents of some positions read as the store was given them (exact: the plan's
latents before their codes), the rest as coded: the facts' sentences (``Sample.facts``: the
needle and the distractors), the question (the tokens after the haystack), the filler
(neither), the last 1/256 of the prompt's positions (a recent full-precision window
proportional to the context: 16 at 4k tokens, 32 at 8k) or the last 32, or all; the answer's
tokens, written after the prompt, are read exact in every mode but "coded". The table counts
the losses each mode gives back, and lists each loss's first failing token's margins.

Used to decide where a plan's retrieval losses sit before building a fix for them
(docs/retrieval.md: vartrack's first digit at 8k, multikey at 4k). Seed 11 by default: no
evaluation's (``bench/retrieval.py`` reports seeds 0-3) nor the planner probe's.
``--prompts I,J,...`` reads only those prompts, by index (e.g. the ones the full cache answers
in a ``bench/retrieval.py`` run); ``--shard K/N`` runs every N-th prompt read from the K-th
(one process a core, each its own ``--out``); ``--merge`` of the shards' JSON files writes
the table.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from transformers import DynamicCache

from lorc_fx.cache import LatentCache
from lorc_fx.cache.stores.vector import VectorStore
from lorc_fx.data.retrieval_tasks import Sample
from lorc_fx.plan.plan_file import load_plan
from prompt_shards import (add_prompt_args, described, machine, mine,  # bench/'s own
                           parse_prompt_args, planned_prompts, save, write_table)

RECENT = 32  # the "last 32" mode's positions
SHARE = 256  # the "recent 1/256" mode's: that share of the prompt's last positions
MODES = ("coded", "facts", "question", "filler", f"recent 1/{SHARE}", f"last {RECENT}", "all")


class _ExactReads(VectorStore):
    """A vector store that also keeps the latents it was given, and reads the positions of
    ``exact_at`` (a bool per position; None: none) as given."""

    given: torch.Tensor | None = None
    exact_at: torch.Tensor | None = None

    def append(self, window, new):
        self.given = new.clone() if self.given is None else torch.cat([self.given, new], 2)
        return super().append(window, new)

    def read(self, window):
        read = super().read(window)
        if self.exact_at is None:
            return read
        at = self.exact_at[:read.shape[2]].view(1, 1, -1, 1)
        return torch.where(at, self.given[:, :, :read.shape[2]].to(read.dtype), read)


def _stores(cache: LatentCache) -> list[VectorStore]:
    """The cache's vector-coded sides' stores."""
    return [s for layer in cache.layers for s in (getattr(layer, "k_store", None),
                                                  getattr(layer, "v_store", None))
            if isinstance(s, VectorStore)]


def _margins(model, first: torch.Tensor, answer: list[int], cache) -> list[float]:
    """Each answer token's log-probability less the best other token's, ``first`` (the
    prompt's last token) and then the answer's tokens read one a step."""
    margins, token = [], first
    for t in answer:
        with torch.no_grad():
            logp = model(token, use_cache=True, past_key_values=cache).logits[0, -1].log_softmax(-1)
        margins.append(round(float(logp[t] - logp.clone().index_fill_(0, torch.tensor([t]),
                                                                       -torch.inf).max()), 3))
        token = torch.tensor([[t]])
    return margins


def _positions(sample: Sample, tok, spare: int) -> dict[str, torch.Tensor]:
    """Each mode's positions read exact but "coded"'s, over the prompt's tokens and ``spare``
    positions after them (the answer's)."""
    enc = tok(sample.prompt, return_offsets_mapping=True)
    starts = torch.tensor([a for a, _ in enc.offset_mapping])
    n = len(starts)
    question = torch.zeros(n + spare, dtype=torch.bool)
    question[int((starts < sample.prompt.rindex("\n\n")).sum()):] = True
    fact = torch.zeros(n + spare, dtype=torch.bool)
    for a, b in sample.facts:
        fact[:n] |= (starts >= a) & (starts < b)
    later = torch.arange(n + spare) >= n
    recent = lambda count: torch.arange(n + spare) >= n - count  # noqa: E731
    return {"facts": fact | later, "question": question,
            "filler": ~fact & ~question | later, f"recent 1/{SHARE}": recent(-(-n // SHARE)),
            f"last {RECENT}": recent(RECENT), "all": torch.ones(n + spare, dtype=torch.bool)}


def measure(model, tok, plan, sample: Sample) -> dict[str, list[float]]:
    """The full cache's margins and the plan's as coded, on one prompt; where the full cache
    answers and the plan does not, the plan's in every other mode too."""
    ids, answer = torch.tensor([sample.input_ids]), sample.answer_ids(tok)
    out, full = {}, DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, past_key_values=full)
    out["full cache"] = _margins(model, ids[:, -1:], answer, full)
    cache = LatentCache.from_cache(DynamicCache(config=model.config), plan)
    for store in _stores(cache):
        store.__class__ = _ExactReads
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, past_key_values=cache)

    def read(exact_at: torch.Tensor | None) -> list[float]:
        """The margins through a copy of the prefilled cache, ``exact_at`` read exact."""
        copied = copy.deepcopy(cache)
        for store in _stores(copied):
            store.exact_at = exact_at
        return _margins(model, ids[:, -1:], answer, copied)

    out["coded"] = read(None)
    if _answers(out["full cache"]) and not _answers(out["coded"]):
        out.update((mode, read(at)) for mode, at in
                   _positions(sample, tok, len(answer) + 1).items())
    return out


def _answers(margins: list[float]) -> bool:
    """Whether greedy decoding writes the answer: every token's margin positive."""
    return min(margins) > 0


def table(prompts: dict[str, dict[str, list[float]]]) -> list[str]:
    full = [i for i, p in prompts.items() if _answers(p["full cache"])]
    lost = [i for i in full if not _answers(prompts[i]["coded"])]
    found = [i for i, p in prompts.items() if _answers(p["coded"]) and i not in full]
    lines = [f"The full cache answers {len(full)} of {len(prompts)} prompts, the plan "
             f"(coded) {sum(_answers(p['coded']) for p in prompts.values())}: {len(lost)} of the "
             f"full cache's lost, {len(found)} others found.", "",
             "| read exact | " + " | ".join(MODES[1:]) + " |", "|---" * len(MODES) + "|",
             "| losses given back | " + " | ".join(
                 f"{sum(_answers(prompts[i][m]) for i in lost)} of {len(lost)}" for m in MODES[1:])
             + " |", "", "Each loss's first failing answer token, its margin (nats) in each mode:",
             "", "| prompt | token | full cache | " + " | ".join(MODES) + " |",
             "|---|---|---" + "|---" * len(MODES) + "|"]
    for i in lost:
        p = prompts[i]
        t = next(j for j, m in enumerate(p["coded"]) if m <= 0)
        lines.append(f"| {i} | {t} | {p['full cache'][t]:+.2f} | "
                     + " | ".join(f"{p[m][t]:+.2f}" for m in MODES) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_args(ap, "a saved vector-coded plan (report.save)", "multikey", "4k", 50, 11,
                    "bench/results/retrieval_positions-cpu")
    args = parse_prompt_args(ap)
    plan = load_plan(args.plan)  # checked before the model loads
    if plan.scheme.name != "vector":
        raise SystemExit(f"--plan: {args.plan} is a {plan.scheme.name} plan; this reads "
                         "vector codes exact, so it takes a vector-coded plan (below 4.5 bits)")
    length, model, tok, plan, samples = planned_prompts(args)
    per_prompt = {}
    for i in mine(args, len(samples)):
        per_prompt[str(i)] = measure(model, tok, plan, samples[i])
        print(i, {m: _answers(v) for m, v in per_prompt[str(i)].items()}, flush=True)
    every = save(args, length, plan.bits_per_value, per_prompt, len(samples))
    if every is not None:
        write_table(args, [
            f"Where a plan's retrieval losses sit (`bench/retrieval_positions.py`): {args.task}, "
            f"{length} tokens, {described(args)}, answers "
            f"teacher-forced, plan {Path(args.plan).name} ({plan.bits_per_value:.3f} bits per "
            f"value); {machine()}.", "", *table(every)])


if __name__ == "__main__":
    main()
