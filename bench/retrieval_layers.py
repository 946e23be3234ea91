"""Which layers' codes cost retrieval: a plan's cache coded one layer at a time.

    python bench/retrieval_layers.py --plan PLAN [--task multikey] [--length 1k]
        [--trials 24] [--seed 7] [--shard K/N] [--merge A.json,...] [--out PREFIX]

For each prompt, one forward writes the full cache and caches of variants of the saved plan
(``--plan``): every layer coded (the plan), and each layer coded alone, every other layer's
keys and values as they came (``search.retrieval_probe``, what the planner measures on
prompts of its own seed; before 2026-11-29 the other layers kept their latents as floats at
the plan's ranks, the baseline "no layer coded" of the saved results). Each then reads the
answer's tokens (``search.one_prefill.answer_logprobs``; the results of 2026-11-28 read them
one step at a time, which the tests show the same), and the table gives per layer the mean
change of the answer's log-probability when only that layer is coded, and its mean absolute
change (what moves the answer either way), against the full cache.
Greedy accuracy is ``bench/retrieval.py``'s; the log-probability moves before an answer
flips, so two dozen prompts tell layers apart.

The default seed (7) is none of the evaluation's (``bench/retrieval.py`` reports seeds 0
and 1): what this shows may guide a plan without tuning it on the prompts it is judged by.
``--shard K/N`` runs every N-th prompt from the K-th (one process a core, each its own
``--out``); ``--merge`` of the shards' JSON files writes the table.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import lorc_fx
from lorc_fx.search.one_prefill import FULL, answer_logprobs
from lorc_fx.search.retrieval_probe import one_layer_coded
from prompt_shards import (add_prompt_args, machine, mine, planned_prompts, save,  # bench/'s own
                           write_table)


def variants(plan):
    """The plan (every layer coded), then each layer coded alone."""
    return {"every layer": plan, **one_layer_coded(plan)}


def table(scores: dict[str, list[float]]) -> list[str]:
    """Markdown rows: per cache the mean answer log-probability and, against the full
    cache, its mean change and mean absolute change, per prompt."""
    base = scores[FULL]
    rows = ["| cache | mean answer log-probability | mean change against the full cache "
            "| mean absolute change |", "|---|---|---|---|"]
    for name, values in scores.items():
        change = [v - b for v, b in zip(values, base, strict=True)]
        rows.append(f"| {name} | {statistics.mean(values):.3f} | {statistics.mean(change):+.3f} "
                    f"| {statistics.mean(map(abs, change)):.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_args(ap, "a saved plan (report.save)", "multikey", "1k", 24, 7,
                    "bench/results/retrieval_layers-cpu")
    args = ap.parse_args()
    length, model, tok, plan, samples = planned_prompts(args)
    blocks = lorc_fx.analyze(model)
    indices = mine(args, len(samples))
    prompts = [(samples[i].input_ids, samples[i].answer_ids(tok)) for i in indices]
    scores = answer_logprobs(model, prompts, variants(plan), blocks)
    per_prompt = {str(i): {name: values[j] for name, values in scores.items()}
                  for j, i in enumerate(indices)}
    every = save(args, length, plan.bits_per_value, per_prompt, len(samples))
    if every is None:
        return
    names = next(iter(every.values())).keys()
    merged = {name: [p[name] for p in every.values()] for name in names}
    write_table(args, [
        f"Answer log-probabilities through a plan's cache coded one layer at a time "
        f"(`bench/retrieval_layers.py`): {args.task}, {length} tokens, {args.trials} "
        f"prompts of seed {args.seed}, plan {Path(args.plan).name} "
        f"({plan.bits_per_value:.3f} bits per value); {machine()}.", "", *table(merged)])


if __name__ == "__main__":
    main()
