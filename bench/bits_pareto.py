"""LoRC's planner over rank × bits against a KIVI-style quantized KV cache at equal bits per
value, on news, Austen and a held-out genre (poems) (issue #13, parts 2 and 3).

    OMP_NUM_THREADS=1 python bench/bits_pareto.py [--budgets 8.5,4.5,3,2.56,1.92]
        [--texts news,austen,poems] [--tokens 4096] [--kivi 8:64,4:64,3:64,2:32,2:64]
        [--stem bits_pareto-cpu]

**LoRC**: ``lorc_fx.compress(model, bits_per_value=B)`` at default options: the planner
measures plain 8/4-bit KV quantization where it fits (KIVI's layout), keys water-filled over
8/4/3-bit latent rows beside plain 4-bit values (``schemes.keys_waterfilled``), where no plain
quantization fits the budget vector codes of full-rank latents (``schemes.vector``: the
first such budget fits the model's codebooks, ~20 min on 2 threads, cached), and then every
low-rank candidate (16/8/4-bit latents in groups of 32 or 64 tokens at the rank that fills
the budget, for both RoPE modes) on held-out calibration windows of text sampled from the
model and keeps the least loss (a plain candidate within 0.002 nats of the uncompressed
model's loss ends the search). Each kept plan is scored through the
real latent cache (``score_windows``: a fresh cache per batch of 2 windows of 512 tokens,
every window a whole number of groups, so every latent is read quantized, no full-precision
window; a vector plan keeps each window's first token as it came, its sink). Bits per value: the plan's, and measured from the cache's tensors (floats at 16
bits; below the plan's in reconstruct mode: the batch shares one row of RoPE angles).

**KIVI-style**: ``kv_quant_baseline.KiviCache`` with no full-precision window (R=0), keys per
channel and values per token over groups of G, float16 scale and zero point per group.

Writes ``bench/results/bits_pareto-cpu.{json,md,png}``; results already in the JSON are kept
(an interrupted run resumes; ``--fresh`` starts over).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.data.texts import load_text  # noqa: E402
from lorc_fx.eval.evaluate import evaluation_windows, score_windows  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from kv_quant_baseline import kivi_bits_asymptotic, score_kivi  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEM = "bits_pareto-cpu"
GOALS = {8.5: 1.001, 4.5: 1.015, 2.56: 1.05, 1.92: 1.10}  # issue #13: ratio at most, per budget


def _save(doc: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{STEM}.json").write_text(json.dumps(doc, indent=1) + "\n")


def write_table(doc: dict) -> None:
    texts = doc["meta"]["texts"]
    rows = sorted(doc["results"], key=lambda r: (-r["bits_per_value"], r["method"]))
    lines = ["# Planner over rank × bits vs KIVI-style KV quantization (CPU)", "",
             doc["meta"]["note"], "", f"Machine: {doc['meta']['machine']}. "
             f"{doc['meta']['tokens']} evaluation tokens per text in windows of "
             f"{doc['meta']['window']}. Uncompressed perplexity: "
             + ", ".join(f"{t} {doc['full_ppl'][t]:.3f}" for t in texts), "",
             "| method | choice | bits per value (plan) | measured | "
             + " | ".join(f"{t} ratio" for t in texts) + " | goal |",
             "|---|---|---|---|" + "---|" * len(texts) + "---|"]
    for r in rows:
        goal = GOALS.get(r.get("budget"))
        met = ("" if goal is None else
               f"≤ ×{goal}: " + ("met" if all(r["ratio"][t] <= goal for t in texts) else "missed"))
        lines.append(f"| {r['method']} | {r['choice']} | {r['bits_per_value']:.3f} | "
                     f"{r['bits_per_value_measured']:.3f} | "
                     + " | ".join(f"×{r['ratio'][t]:.4f}" for t in texts) + f" | {met} |")
    lines += ["", "Candidates the planner measured (held-out calibration loss, nats/token; "
              "best first):", ""]
    for r in rows:
        if r["method"].startswith("LoRC"):
            lines.append(f"- {r['method']}: " + "; ".join(
                f"{c['candidate']} {c['bits_per_value']:.2f} b → {c['loss']:.4f}"
                for c in r["candidates"] if "skipped" not in c)
                + f" (planned in {r['plan_seconds']:.0f} s)")
    (RESULTS / f"{STEM}.md").write_text("\n".join(lines) + "\n")


def plot(doc: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = doc["meta"]["texts"]
    fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts), 4), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for series, style in (("KIVI", "s--"), ("LoRC", "o-")):
            rs = sorted((r for r in doc["results"] if r["method"].startswith(series)),
                        key=lambda r: r["bits_per_value"])
            ax.plot([r["bits_per_value"] for r in rs], [r["ratio"][text] for r in rs], style,
                    label="KIVI-style, R=0" if series == "KIVI" else "LoRC, rank × bits planner")
        for budget, goal in GOALS.items():
            ax.plot([budget], [goal], "k_", markersize=14)
        ax.set_yscale("log")
        ax.set_ylim(0.99, 3.0)
        ax.set_xlabel("bits per cached K/V value (16 = unchanged)")
        ax.set_ylabel("perplexity ratio to the uncompressed model")
        ax.set_title(text + (" (held-out genre)" if text == "poems" else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, title="black bars: goals", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{STEM}.png", dpi=110)


def main() -> None:
    global STEM
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="8.5,4.5,3,2.56,1.92")
    parser.add_argument("--texts", default="news,austen,poems")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kivi", default="8:64,4:64,3:64,2:32,2:64", help="bits:group, R=0")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--stem", default=STEM, help="results file names (another keeps the "
                        "default results apart, e.g. a longer evaluation)")
    args = parser.parse_args()
    STEM = args.stem
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("lorc_fx.schemes.vector").setLevel(logging.INFO)  # what it measured
    path = RESULTS / f"{STEM}.json"
    doc = json.loads(path.read_text()) if path.exists() and not args.fresh else None
    if args.report_only:
        write_table(doc)
        plot(doc)
        return
    texts = args.texts.split(",")
    doc = doc or {"full_ppl": {}, "results": []}
    doc["meta"] = {
        "tokens": args.tokens, "window": args.window, "texts": texts,
        "model": "default (SmolLM2-135M, float32)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                   f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch {torch.__version__}",
        "note": ("Bits per cached K/V value, everything counted (codes, 16-bit scales and zero "
                 "points, LoRC's RoPE angle log: an angle per rotary pair and a magnitude a "
                 "token), every stored float at 16 bits: 16 = an "
                 "uncompressed 16-bit cache. LoRC rows: `compress(model, bits_per_value=B)` at "
                 "default options (the planner measures plain 8/4-bit quantization in KIVI's "
                 "layout first, then keys water-filled over 8/4/3-bit latent rows beside plain "
                 "4-bit values, then (where no plain quantization fits) product vector codes of "
                 "full-rank latents, then latents at 16/8/4 bits per channel over groups of 32 or 64 "
                 "tokens at the rank filling the budget, and keeps the least held-out "
                 "calibration loss; a plain candidate within 0.002 nats of the full model ends "
                 "the search). KIVI rows: "
                 "keys per channel, values per token, groups of G, no full-precision window. "
                 "Both score each 512-token window in one forward, every token quantized."),
    }
    done = {r["method"] for r in doc["results"]}
    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    windows = {t: evaluation_windows(tokenizer, load_text(t), args.tokens, args.window)
               for t in texts}
    for t in texts:
        if t not in doc["full_ppl"]:
            doc["full_ppl"][t] = score_windows(model, windows[t], False).ppl
    _save(doc)
    head_dim = model.config.head_dim
    for spec in args.kivi.split(","):
        bits, group = map(int, spec.split(":"))
        method = f"KIVI int{bits} G{group}"
        if method in done:
            continue
        row = {"method": method, "choice": "keys per channel, values per token",
               "bits_per_value": kivi_bits_asymptotic(bits, group, head_dim), "ratio": {}}
        measured = []
        for t in texts:
            ppl, seen = score_kivi(model, windows[t], bits, group, 0)
            row["ratio"][t] = ppl / doc["full_ppl"][t]
            measured.append(seen)
        row["bits_per_value_measured"] = sum(measured) / len(measured)
        doc["results"].append(row)
        _save(doc)
        print(json.dumps(row), flush=True)
    blocks = lorc_fx.analyze(model)
    for budget in map(float, args.budgets.split(",")):
        method = f"LoRC {budget:g} bits"
        if method in done:
            continue
        start = time.perf_counter()
        report = lorc_fx.compress(model, bits_per_value=budget, blocks=blocks)
        plan = report.plan
        choice = plan.scheme.summary(plan)
        row = {"method": method, "budget": budget, "choice": choice,
               "bits_per_value": plan.bits_per_value, "candidates": plan.candidates,
               "plan_seconds": time.perf_counter() - start, "ratio": {}}
        measured = []
        for t in texts:
            scores = score_windows(model, windows[t], True)
            row["ratio"][t] = scores.ppl / doc["full_ppl"][t]
            measured.append(scores.bits_per_value)
        row["bits_per_value_measured"] = sum(measured) / len(measured)
        row["seconds"] = time.perf_counter() - start
        doc["results"].append(row)
        _save(doc)
        print(json.dumps({k: v for k, v in row.items() if k != "candidates"}), flush=True)
    write_table(doc)
    plot(doc)


if __name__ == "__main__":
    main()
