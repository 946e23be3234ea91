"""Does shrinking the calibration statistics toward isotropy help the bases generalise?

    OMP_NUM_THREADS=1 python bench/shrinkage.py --alphas 0,0.05,0.2 \\
        --texts news,austen,pydoc,code,poems --fractions 0.8,0.6 --tokens 2048 --out rows.jsonl

Every second moment the data-aware bases read (the K/V input gram ``E[x xᵀ]`` and the
attention moments of values, keys and queries) is replaced by ``(1−α)·M + α·(tr M / D)·I``
(Ledoit–Wolf's target, the scaled identity) before the bases are taken; α = 0 is the
default. Calibration is the default (text sampled from the model); the split search runs
per α (its cache is keyed by α here). ``poems`` is the held-out genre: α is judged on the
other texts only. Rows are appended to ``--out`` as they come.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace

import torch

from lorc_fx.api import compress
from calibration_sources import scored_texts  # bench/ is on the path of its scripts
from lorc_fx.data.models import load_model
from lorc_fx.eval.evaluate import score_windows
from lorc_fx.plan import calibration
from lorc_fx.search import split


def shrunk(m: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(1−α)·M + α·(tr M / D)·I`` for each trailing ``D×D`` matrix of ``m``."""
    d = m.shape[-1]
    scale = m.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    return (1 - alpha) * m + alpha * scale * torch.eye(d, dtype=m.dtype)


_MEASURED = calibration.layer_statistics


def shrink_statistics(alpha: float) -> None:
    """Make every plan from now on read statistics shrunk by ``alpha`` (and cache its
    split search apart from other α)."""
    def patched(*args, **kwargs):
        stats = _MEASURED(*args, **kwargs)
        for s in stats.values():
            s.input_gram = shrunk(s.input_gram, alpha)
            if s.attention is not None:
                a = s.attention
                s.attention = replace(a, values=shrunk(a.values, alpha), keys=shrunk(a.keys, alpha),
                                      queries=shrunk(a.queries, alpha))
        return stats

    calibration.layer_statistics = patched
    split._FORMAT = f"4-shrink-{alpha}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alphas", default="0,0.05,0.2")
    p.add_argument("--texts", default="news,austen,pydoc,code,poems")
    p.add_argument("--fractions", default="0.8,0.6")
    p.add_argument("--tokens", type=int, default=2048, help="evaluated tokens per text")
    p.add_argument("--out", default="shrinkage.jsonl")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)

    texts = args.texts.split(",")
    windows, full = scored_texts(texts, args.tokens)
    with open(args.out, "a") as out:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            shrink_statistics(alpha)
            for fraction in [float(f) for f in args.fractions.split(",")]:
                model = load_model("default")
                t0 = time.perf_counter()
                report = compress(model, fraction)
                o = report.plan.options
                print(f"== alpha {alpha} f={fraction}: rope {o.rope}, key fraction "
                      f"{o.key_fraction:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
                for t in texts:
                    c = score_windows(model, windows[t], True, reference=model)
                    agree = c.top1_agreement
                    row = {"alpha": alpha, "fraction": fraction, "text": t, "tokens": args.tokens,
                           "ppl_full": full[t].ppl, "ppl": c.ppl, "ratio": c.ppl / full[t].ppl,
                           "top1": agree, "kl": c.kl_mean, "rope": o.rope,
                           "key_fraction": o.key_fraction}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"   {t:7s} x{row['ratio']:.4f} top1 {agree:.3f}", flush=True)


if __name__ == "__main__":
    main()
