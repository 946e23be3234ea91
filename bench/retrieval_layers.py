"""Which layers' codes cost retrieval: a plan's cache coded one layer at a time; or which of
several plans' codes cost it least.

    python bench/retrieval_layers.py --plan PLAN [--task multikey] [--length 1k]
        [--trials 24] [--seed 7] [--prompts I,J,...] [--shard K/N] [--merge A.json,...]
        [--out PREFIX]
    python bench/retrieval_layers.py --plan LABEL=PLAN,LABEL=PLAN,... [...]

For each prompt, one forward writes the full cache and caches of variants of the saved plan
(``--plan``): every layer coded (the plan), and each layer coded alone, every other layer's
keys and values as they came (``search.retrieval_probe``, what the planner measures on
prompts of its own seed; before 2026-11-29 the other layers kept their latents as floats at
the plan's ranks, the baseline "no layer coded" of the saved results). Each then reads the
answer's tokens (``search.one_prefill.answer_logprobs``; the results of 2026-11-28 read them
one step at a time, which the tests show the same), and the table gives per layer the mean
change of the answer's log-probability when only that layer is coded, and its mean absolute
change (what moves the answer either way), against the full cache.
With several plans (``LABEL=PATH``, comma-separated) each is read whole, every layer coded,
side by side with the others from the same prefill: no layer alone.
Greedy accuracy is ``bench/retrieval.py``'s; the log-probability moves before an answer
flips, so two dozen prompts tell layers apart.

The default seed (7) is none of the evaluation's (``bench/retrieval.py`` reports seeds 0
and 1): what this shows may guide a plan without tuning it on the prompts it is judged by.
``--prompts I,J,...`` reads only those prompts, by index (e.g. the ones the full cache answers
in a ``bench/retrieval.py`` run); ``--shard K/N`` runs every N-th prompt read from the K-th
(one process a core, each its own ``--out``); ``--merge`` of the shards' JSON files writes
the table.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import lorc_fx
from lorc_fx.search.one_prefill import FULL, answer_logprobs
from lorc_fx.search.retrieval_probe import one_layer_coded
from prompt_shards import (add_prompt_args, described, machine, mine,  # bench/'s own
                           parse_prompt_args, planned_prompts, prompts_for, save, write_table)


def variants(plan):
    """The plan (every layer coded), then each layer coded alone."""
    return {"every layer": plan, **one_layer_coded(plan)}


def labelled(plans: str) -> dict[str, str] | None:
    """``--plan``'s ``LABEL=PATH`` pairs, comma-separated; None for a single path."""
    if "=" not in plans:
        return None
    pairs = plans.split(",")
    if not all("=" in pair for pair in pairs):
        raise SystemExit(f"--plan: several plans are LABEL=PATH pairs, comma-separated; got "
                         f"{plans!r}")
    return dict(pair.split("=", 1) for pair in pairs)


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
    add_prompt_args(ap, "a saved plan (report.save), or several as LABEL=PATH,...",
                    "multikey", "1k", 24, 7, "bench/results/retrieval_layers-cpu")
    args = parse_prompt_args(ap)
    several = labelled(args.plan)
    if several:  # the model as it came: each plan's cache is made from the plan itself
        length, model, tok, samples = prompts_for(args)
        read = {label: lorc_fx.load_plan(path, model) for label, path in several.items()}
        bits = {label: plan.bits_per_value for label, plan in read.items()}
        what = "several plans' caches, every layer coded"
        plans = ", ".join(f"{label} ({Path(path).name}, {bits[label]:.3f} bits per value)"
                          for label, path in several.items())
    else:
        length, model, tok, plan, samples = planned_prompts(args)
        read, bits = variants(plan), plan.bits_per_value
        what = "a plan's cache coded one layer at a time"
        plans = f"plan {Path(args.plan).name} ({bits:.3f} bits per value)"
    blocks = lorc_fx.analyze(model)
    indices = mine(args, len(samples))
    prompts = [(samples[i].input_ids, samples[i].answer_ids(tok)) for i in indices]
    scores = answer_logprobs(model, prompts, read, blocks)
    per_prompt = {str(i): {name: values[j] for name, values in scores.items()}
                  for j, i in enumerate(indices)}
    every = save(args, length, bits, per_prompt, len(samples))
    if every is None:
        return
    names = next(iter(every.values())).keys()
    merged = {name: [p[name] for p in every.values()] for name in names}
    write_table(args, [
        f"Answer log-probabilities through {what} (`bench/retrieval_layers.py`): {args.task}, "
        f"{length} tokens, {described(args)}, {plans}; {machine()}.",
        "", *table(merged)])


if __name__ == "__main__":
    main()
