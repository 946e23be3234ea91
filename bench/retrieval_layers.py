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
import json
import platform
import statistics
from pathlib import Path

import torch

import lorc_fx
from lorc_fx.data.models import load_tokenizer
from lorc_fx.data.retrieval_tasks import TASKS, make_samples
from lorc_fx.eval.retrieval import parse_lengths
from lorc_fx.search.one_prefill import FULL, answer_logprobs
from lorc_fx.search.retrieval_probe import one_layer_coded


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
    ap.add_argument("--plan", required=True, help="a saved plan (report.save)")
    ap.add_argument("--task", default="multikey", choices=TASKS)
    ap.add_argument("--length", default="1k")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--shard", default="0/1", help="K/N: the prompts whose index is K modulo N")
    ap.add_argument("--merge", default="", help="other shards' OUT.json, comma-separated")
    ap.add_argument("--out", default="bench/results/retrieval_layers-cpu")
    args = ap.parse_args()
    k, n = map(int, args.shard.split("/"))
    (length,) = parse_lengths(args.length)

    model = lorc_fx.load_model("default")
    tok = load_tokenizer()
    plan = lorc_fx.compress(model, plan=args.plan).plan
    blocks = lorc_fx.analyze(model)
    samples = make_samples(tok, args.task, length, args.trials, args.seed)
    mine = [i for i in range(len(samples)) if i % n == k]
    prompts = [(samples[i].input_ids, samples[i].answer_ids(tok)) for i in mine]
    scores = answer_logprobs(model, prompts, variants(plan), blocks)
    per_prompt = {str(i): {name: values[j] for name, values in scores.items()}
                  for j, i in enumerate(mine)}
    for other in filter(None, args.merge.split(",")):
        per_prompt.update(json.loads(Path(other).read_text())["prompts"])
    settings = {"plan": args.plan, "task": args.task, "length": length, "trials": args.trials,
                "seed": args.seed, "bits_per_value": plan.bits_per_value}
    machine = (f"{platform.machine()}, {torch.get_num_threads()} thread(s), "
               f"torch {torch.__version__}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "machine": machine, "prompts": per_prompt}, indent=1))
    if len(per_prompt) < len(samples):
        print(f"{len(per_prompt)} of {len(samples)} prompts: merge the other shards")
        return
    names = next(iter(per_prompt.values())).keys()
    merged = {name: [per_prompt[str(i)][name] for i in range(len(samples))] for name in names}
    lines = [f"Answer log-probabilities through a plan's cache coded one layer at a time "
             f"(`bench/retrieval_layers.py`): {args.task}, {length} tokens, {args.trials} "
             f"prompts of seed {args.seed}, plan {Path(args.plan).name} "
             f"({plan.bits_per_value:.3f} bits per value); {machine}.", "", *table(merged)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
