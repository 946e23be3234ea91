"""Calibration sources compared on the default model: perplexity ratio (latent cache / full
cache) per calibration source x cache fraction x evaluation text, default options otherwise.

    OMP_NUM_THREADS=1 python bench/calibration_sources.py \\
        --sources self,news,self+news,news+austen,self:8192:256 \\
        --texts news,austen,pydoc,code,poems --fractions 0.8,0.6 --tokens 2048 --out rows.jsonl

A source is calibration texts joined by ``+``, optionally ``:TOKENS:WINDOW`` (default: those
of ``CalibrationOptions()``). Evaluation windows come from each text's evaluation part, which
calibration never reads. The full model is scored once per text; each compressed model
through a fresh latent cache. Rows are appended to ``--out`` as they come; ``plan_seconds``
is the wall time of ``compress`` (sampling, calibration and split search where not cached).
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from lorc_fx.api import compress
from lorc_fx.data.models import load_model, load_tokenizer
from lorc_fx.data.texts import load_text
from lorc_fx.eval.evaluate import evaluation_windows, score_windows
from lorc_fx.plan.options import CalibrationOptions


def calibration_of(source: str) -> CalibrationOptions:
    texts, *size = source.split(":")
    default = CalibrationOptions()
    tokens, window = (int(size[0]), int(size[1])) if size else (default.tokens, default.window)
    return CalibrationOptions(texts=tuple(texts.split("+")), tokens=tokens, window=window)


def scored_texts(texts: list[str], tokens: int) -> tuple[dict, dict]:
    """Per text: ``tokens`` tokens of its evaluation part in windows of 512, and the full
    (uncompressed) default model's scores on them."""
    tok = load_tokenizer("default")
    windows = {t: evaluation_windows(tok, load_text(t), tokens, 512) for t in texts}
    model = load_model("default")
    full = {}
    for t in texts:
        t0 = time.perf_counter()
        full[t] = score_windows(model, windows[t], False)
        print(f"full {t} ppl {full[t].ppl:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return windows, full


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", default="self,news,self+news,news+austen")
    p.add_argument("--texts", default="news,austen,pydoc,code,poems")
    p.add_argument("--fractions", default="0.8,0.6")
    p.add_argument("--tokens", type=int, default=2048, help="evaluated tokens per text")
    p.add_argument("--out", default="calibration_sources.jsonl")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)

    texts = args.texts.split(",")
    windows, full = scored_texts(texts, args.tokens)
    with open(args.out, "a") as out:
        for fraction in [float(f) for f in args.fractions.split(",")]:
            for source in args.sources.split(","):
                calibration = calibration_of(source)
                model = load_model("default")
                t0 = time.perf_counter()
                report = compress(model, fraction, calibration=calibration)
                plan_s = time.perf_counter() - t0
                o = report.plan.options
                print(f"== {source} f={fraction}: plan {plan_s:.0f} s, basis {o.basis}, "
                      f"rope {o.rope}, key fraction {o.key_fraction:.3f}", flush=True)
                for t in texts:
                    t1 = time.perf_counter()
                    c = score_windows(model, windows[t], True, reference=model)
                    agree = c.top1_agreement
                    row = {"source": source, "calibration_tokens": calibration.tokens,
                           "calibration_window": calibration.window, "fraction": fraction,
                           "text": t, "tokens": args.tokens, "ppl_full": full[t].ppl,
                           "ppl": c.ppl, "ratio": c.ppl / full[t].ppl, "top1": agree,
                           "kl": c.kl_mean,
                           "plan_seconds": plan_s, "rope": o.rope, "key_fraction": o.key_fraction,
                           "eval_seconds": time.perf_counter() - t1}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"   {t:7s} x{row['ratio']:.4f} top1 {agree:.3f} KL {c.kl_mean:.4f} "
                          f"({row['eval_seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
