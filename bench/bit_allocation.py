"""Per-layer, per-side bit widths at 4.5 bits per value (issue #13): would a planner that
picks a width for each layer's keys and for its values beat one width for the whole cache?
An experiment on bench/int4_variants.py's fake-quantizing cache, not wired into the planner;
results and their reading in bench/results/bit_allocation-cpu.md.

    OMP_NUM_THREADS=1 python bench/bit_allocation.py [--layout base] [--evaluate news,austen,poems]

1. Sensitivity, on the planner's held-out windows (text the model sampled itself, never an
   evaluation text): for each side (layer × keys/values), the loss change when that side
   alone is stored at 8 bits, and alone at 3 bits, every other side at 4 (``--layout``).
2. Allocation: sides raised to 8 bits (+4 bits per value each) paid for by sides lowered to
   3 bits (−1 each), the set with the least summed sensitivity among those that keep the
   mean at most at the layout's (the sensitivities are assumed to add).
3. The layout and the allocation on the evaluation texts (4096 tokens each, windows of 512).

Sensitivities are kept in bench/results/bit_allocation-cpu.json as they are measured, so an
interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import int4_variants as iv  # noqa: E402  (sets OMP_NUM_THREADS before torch loads)

import torch  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.eval.evaluate import evaluation_windows  # noqa: E402

OUT = Path(__file__).parent / "results" / "bit_allocation-cpu.json"
WIDER, NARROWER = 8, 3


def sides(layers: int) -> list[str]:
    return [f"{side}:{layer}" for layer in range(layers) for side in "kv"]


def with_widths(layout: str, widths: dict[str, int]) -> str:
    """The ``int4_variants.variant`` name of ``layout`` with these sides at these widths."""
    return "+".join([layout] + [f"{s.split(':')[0]}{b}:{s.split(':')[1]}"
                                for s, b in sorted(widths.items())])


def allocate(sensitivity: dict[str, dict[str, float]]) -> tuple[dict[str, int], float]:
    """The widths (side → 8 or 3) whose summed predicted loss change is least, with four
    sides at 3 bits for each side at 8; and that predicted change."""
    gains = sorted(sensitivity, key=lambda s: sensitivity[s][str(WIDER)])
    best, best_change = {}, 0.0
    for raised in range(1, len(gains) // 5 + 1):
        up = gains[:raised]
        down = sorted((s for s in sensitivity if s not in up),
                      key=lambda s: sensitivity[s][str(NARROWER)])[:4 * raised]
        change = (sum(sensitivity[s][str(WIDER)] for s in up)
                  + sum(sensitivity[s][str(NARROWER)] for s in down))
        if change < best_change:
            best = {**{s: WIDER for s in up}, **{s: NARROWER for s in down}}
            best_change = change
    return best, best_change


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="base", help="an int4_variants variant: every side's layout")
    ap.add_argument("--evaluate", default="news,austen,poems")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    iv.install_hooks(model)
    layers = model.config.num_hidden_layers
    held = iv.self_sets(model)["self_held"]
    record = json.loads(OUT.read_text()) if OUT.exists() else {}
    run = record.setdefault(args.layout, {"sensitivity": {}})

    def loss_of(name: str, windows) -> tuple[float, float]:
        cfgs, sink = iv.variant(name, layers)
        loss, bits, _ = iv.score(model, windows, cfgs, sink)
        return loss, bits

    if "held_loss" not in run:
        run["held_loss"], run["bits"] = loss_of(args.layout, held)
    todo = [s for s in sides(layers) if s not in run["sensitivity"]]
    start = time.time()
    for i, side in enumerate(todo):
        run["sensitivity"][side] = {
            str(width): loss_of(with_widths(args.layout, {side: width}), held)[0] - run["held_loss"]
            for width in (WIDER, NARROWER)}
        OUT.write_text(json.dumps(record, indent=1))
        print(f"{side}: {run['sensitivity'][side]} ({i + 1}/{len(todo)}, "
              f"{time.time() - start:.0f}s)", flush=True)

    widths, predicted = allocate(run["sensitivity"])
    mixed = with_widths(args.layout, widths)
    run["allocation"] = {"widths": widths, "predicted_held_change": predicted}
    run["allocation"]["held_change"] = loss_of(mixed, held)[0] - run["held_loss"]
    full = json.loads(iv.OUT.with_name("int4_variants_full-cpu.json").read_text())
    for text in args.evaluate.split(","):
        windows = evaluation_windows(tok, lorc_fx.load_text(text), 4096, 512)
        key = f"{text}:{tuple(windows.shape)}"
        if key not in full:
            raise SystemExit(f"no full-model loss for {key}: run bench/int4_variants.py --sets {text}")
        for name, label in ((args.layout, "layout"), (mixed, "allocation")):
            loss, bits = loss_of(name, windows)
            run.setdefault("texts", {}).setdefault(text, {})[label] = {
                "ratio": math.exp(loss - full[key]["loss"]), "bits": bits}
            print(f"{text} {label}: x{math.exp(loss - full[key]['loss']):.4f} at {bits:.3f} bits",
                  flush=True)
        OUT.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
