"""Warm prefill of the default model, full cache under Inductor against the default options at
``--fraction`` under ``lorc_backend`` (issue #14's deliverable 3), both models in ONE process
and timed alternately (full, LoRC, LoRC, full, ...), so that what differs between processes
(memory placement, the other core's load) falls on both alike. bench/long_context.py times
each variant in its own process, where the prefills of one variant agree within 3% but
separate processes differ by 3-5%.

    OMP_NUM_THREADS=1 python bench/prefill_ab.py --context 1024 --batch 1 --rounds 6

Each prefill is a ``generate`` of one token with a static cache (bench/long_context.py's
``_generate``), warm: both graphs are compiled by an untimed first call. Appends a record
(every time, the fastest and median of each, their ratios full ÷ LoRC: above 1 is LoRC
faster) to bench/results/prefill_ab-cpu.jsonl.
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
from transformers import LogitsProcessor  # noqa: E402

import lorc_fx  # noqa: E402
from long_context import _generate, _prompt_ids  # noqa: E402

OUT = Path(__file__).parent / "results" / "prefill_ab-cpu.jsonl"


class _Stamp(LogitsProcessor):
    """Records when generate first asks for logits processing: the end of the prefill."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        self.at = self.at or time.perf_counter()
        return scores


def prefill_seconds(model, ids) -> float:
    stamp = _Stamp()
    _, start = _generate(model, ids, 1, stamp)
    return stamp.at - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6, help="timed prefills of each variant")
    ap.add_argument("--fraction", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    tokenizer = lorc_fx.load_tokenizer("default")
    full = lorc_fx.load_model("default")
    full.compile()
    compressed = lorc_fx.load_model("default")
    report = lorc_fx.compress(compressed, cache_fraction=args.fraction)
    compressed.compile(backend=lorc_fx.lorc_backend)
    ids = _prompt_ids(tokenizer, args.context, args.batch)
    variants = {"full": full, "lorc": compressed}
    for model in variants.values():
        prefill_seconds(model, ids)  # compiles

    times = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(prefill_seconds(variants[name], ids))
        print(f"round {round_}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in variants),
              flush=True)

    record = {"context": args.context, "batch": args.batch, "fraction": args.fraction,
              "kind": report.plan.scheme.name, "latent_bits": report.plan.options.latent_bits,
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(), "times_s": times,
              "fastest_ratio": min(times["full"]) / min(times["lorc"]),
              "median_ratio": statistics.median(times["full"]) / statistics.median(times["lorc"])}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"prefill full ÷ LoRC: fastest x{record['fastest_ratio']:.3f}, "
          f"median x{record['median_ratio']:.3f} (above 1: LoRC faster)")


if __name__ == "__main__":
    main()
