"""Compiled decode of README's example against the full model's compiled dynamic and static
caches (issue #37's first goal), the three models in ONE process and their ``generate`` calls
alternated round by round, so that what drifts on a shared machine (the other core's load,
its memory traffic) falls on all three alike. bench/long_context.py times each variant in
its own process, minutes apart: on the 2-core machine the same configuration moved by up to
40% between such runs (results/long_context_cache_choice-cpu.md).

    OMP_NUM_THREADS=1 python bench/decode_ab.py --context 4096 --new-tokens 48 --rounds 6

- ``readme``: ``lorc_fx.compress(model, cache_fraction=--fraction)``,
  ``model.compile(backend=lorc_backend)``, ``generate`` with its default cache, as README's
  example is written;
- ``full-dynamic`` / ``full-static``: the uncompressed model, ``model.compile()``, ``generate``
  with its default (dynamic) cache / ``cache_implementation="static"``, both with
  ``TRANSFORMERS_SDPA_FORCE_GQA=1`` (SDPA reads the cache in place: bench/long_context.py's
  faster ``full-gqa`` baseline).

Every round runs one greedy ``generate`` of ``--new-tokens`` tokens after the same
``--context``-token prompt per model, in an order rotated each round; a call's decode time is
the median of its steps after ``--warmup-steps`` (stamped by a ``LogitsProcessor``, as
bench/long_context.py does). A round's ratio is the faster full cache's step over README's
(above 1: README's example faster). Each model's graphs are compiled by an untimed first call,
and the script checks that no timed call compiled another. Appends the record to
bench/results/decode_ab-cpu.jsonl.

``--plan PATH``: a saved plan instead of README's example (``compress(model, plan=PATH)``),
compiled the same way, timed beside the two full caches. One: a second compressed copy of
the model in the process made Dynamo recompile the shared forward at every call, past its
cache limit (tried: the timed calls ran eager and compiled).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import LogitsProcessor  # noqa: E402

import lorc_fx  # noqa: E402
from long_context import _generate, _prompt_ids  # noqa: E402

OUT = Path(__file__).parent / "results" / "decode_ab-cpu.jsonl"
GOAL = 1.3  # issue #37: README's example ≥ 1.3× the faster full cache


class _Stamps(LogitsProcessor):
    """When generate hands over each new token's logits: after the prefill, after every step."""

    def __init__(self):
        self.at = []

    def __call__(self, input_ids, scores):
        self.at.append(time.perf_counter())
        return scores


def decode_steps(model, ids, new_tokens: int, cache: str, warmup: int):
    """The median decode step (ms) of one ``generate``, its first ``warmup`` steps left out,
    and the tokens it gave."""
    stamps = _Stamps()
    out, _ = _generate(model, ids, new_tokens, stamps, cache)
    steps = [b - a for a, b in zip(stamps.at, stamps.at[1:])]
    return 1e3 * statistics.median(steps[warmup:]), out.sequences


def alternated(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Each of ``runs`` (name: a call giving ms) once a round, in an order rotated each round,
    printed as they come; exits where a timed call compiled a graph."""
    graphs = counters["stats"]["unique_graphs"]
    ms = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            ms[name].append(runs[name]())
        print(f"round {round_}: " + ", ".join(f"{n} {ms[n][-1]:.1f} ms" for n in names),
              flush=True)
    if counters["stats"]["unique_graphs"] != graphs:
        raise SystemExit("a timed generate compiled a graph: the timings include a compile")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--warmup-steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--plan", default="", help="a saved plan instead of README's example")
    args = ap.parse_args()
    if args.new_tokens - 1 - args.warmup_steps < 5:
        ap.error(f"--new-tokens {args.new_tokens} leaves fewer than 5 timed steps after "
                 f"--warmup-steps {args.warmup_steps}")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    tokenizer = lorc_fx.load_tokenizer("default")
    ids = _prompt_ids(tokenizer, args.context, 1)
    compressed = "plan" if args.plan else "readme"
    model = lorc_fx.load_model("default")
    report = (lorc_fx.compress(model, plan=args.plan) if args.plan else
              lorc_fx.compress(model, cache_fraction=args.fraction))
    model.compile(backend=lorc_fx.lorc_backend)
    decode_steps(model, ids, args.new_tokens, "none", args.warmup_steps)  # compiles
    variants = {compressed: (model, "none")}
    # read by transformers whenever it traces an SDPA call: set after README's model compiled
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    for name, cache in (("full-dynamic", "none"), ("full-static", "static")):
        model = lorc_fx.load_model("default")
        model.compile()
        decode_steps(model, ids, args.new_tokens, cache, args.warmup_steps)  # compiles
        variants[name] = (model, cache)

    ms = alternated({name: lambda m=model, c=cache: decode_steps(m, ids, args.new_tokens, c,
                                                                 args.warmup_steps)[0]
                     for name, (model, cache) in variants.items()}, args.rounds)

    fastest_full = [min(d, s) for d, s in zip(ms["full-dynamic"], ms["full-static"])]
    ratios = [f / p for f, p in zip(fastest_full, ms[compressed])]
    record = {"context": args.context, "new_tokens": args.new_tokens,
              "warmup_steps": args.warmup_steps,
              **({"plan": args.plan} if args.plan else {"fraction": args.fraction}),
              "kind": {compressed: report.plan.scheme.name},
              "bits_per_value": {compressed: report.plan.bits_per_value},
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "loadavg_end": os.getloadavg(), "step_ms": ms,
              "round_ratios": {compressed: ratios},
              "median_ratio": {compressed: statistics.median(ratios)}}
    at_goal = ""
    if not args.plan:  # README's example: issue #37's goal
        record["rounds_at_goal"] = sum(x >= GOAL for x in ratios)
        at_goal = f"; {record['rounds_at_goal']} of {len(ratios)} rounds at x{GOAL} or more"
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"faster full cache ÷ {compressed}, per round: " + ", ".join(f"x{x:.2f}" for x in ratios)
          + f"; median x{statistics.median(ratios):.2f}{at_goal} (above 1: the compressed "
          "model faster)")


if __name__ == "__main__":
    main()
