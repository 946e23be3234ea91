"""Perplexity, next-token KL and top-1 agreement over a grid of cache fractions and plan
options, as JSON and a PNG."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from torch import nn

from lorc_fx.api import compress
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.schedules import UnreachableFraction

from .evaluate import evaluation_windows, score_windows


@dataclass(frozen=True)
class Config:
    basis: str
    schedule: str
    rope: str | None = None  # None: the sweep's plan options decide

    @property
    def label(self) -> str:
        return "/".join(filter(None, (self.basis, self.schedule, self.rope)))

    def overrides(self) -> dict:
        """What the config changes of the sweep's plan options."""
        rope = {"rope": self.rope} if self.rope else {}
        return {"basis": self.basis, "schedule": self.schedule, **rope}


def parse_configs(text: str) -> list[Config]:
    """``"weight:progressive,attention:calibrated:commute"`` -> configs
    (``basis:schedule[:rope]``)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"config {item!r}: write it as basis:schedule[:rope]")
        out.append(Config(*parts))
    return out


def _load_checkpoint(path: str | None, settings: dict) -> dict | None:
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return data if data.get("settings") == settings else None


def _write(path: str | None, data: dict) -> None:
    if path is not None:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=2)
        os.replace(path + ".tmp", path)


def run_sweep(model: nn.Module, tokenizer, blocks, texts: dict[str, str], fractions: list[float],
              configs: list[Config], tokens: int, window: int = 512,
              options: PlanOptions | None = None, progress: bool = True,
              checkpoint: str | None = None) -> dict:
    """Full and compressed perplexity of every (config, fraction) on every text, with the
    compressed model's next-token KL from the full one and their top-1 agreement.

    With ``checkpoint`` (a JSON path) the result is written after every row, and a run with
    the same settings picks up the rows an interrupted one finished."""
    from tqdm import tqdm

    settings = {"texts": sorted(texts), "tokens": tokens, "window": window,
                "metrics": ["ppl", "kl", "top1"],  # a checkpoint from before KL is not resumed
                "plan_options": {k: repr(v) for k, v in sorted(asdict(options or PlanOptions()).items())}}
    result = _load_checkpoint(checkpoint, settings)
    windows = {name: evaluation_windows(tokenizer, text, tokens, window)
               for name, text in texts.items()}
    if result is None:
        full = {name: score_windows(model, w, False).ppl for name, w in windows.items()}
        result = {"settings": settings, "ppl_full": full, "tokens": tokens, "window": window,
                  "rows": []}
    full, rows = result["ppl_full"], result["rows"]
    done = {(r["config"], r["requested"]) for r in rows}
    bar = tqdm(total=len(configs) * len(fractions), disable=not progress, desc="sweep")
    for config in configs:
        for fraction in fractions:
            bar.set_postfix_str(f"{config.label} {fraction:g}")
            if (config.label, fraction) in done:
                bar.update()
                continue
            row = {"config": config.label, "basis": config.basis, "schedule": config.schedule,
                   "requested": fraction}
            start = time.perf_counter()
            try:
                report = compress(model, fraction, blocks=blocks, options=options,
                                  **config.overrides())
            except UnreachableFraction as err:
                row["error"] = str(err)
            else:
                row["cache_fraction"] = report.plan.cache_fraction
                row["rope"] = report.plan.options.rope
                row["key_fraction"] = report.plan.options.key_fraction
                scores = {name: score_windows(model, w, True, reference=model)
                          for name, w in windows.items()}
                row["ppl"] = {name: s.ppl for name, s in scores.items()}
                row["ratio"] = {name: row["ppl"][name] / full[name] for name in windows}
                row["kl"] = {name: s.kl_mean for name, s in scores.items()}
                row["top1"] = {name: s.top1_agreement for name, s in scores.items()}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            _write(checkpoint, result)
            bar.update()
    bar.close()
    result["fractions"] = fractions
    return result


def plot_sweep(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = list(result["ppl_full"])
    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    labels = sorted({r["config"] for r in result["rows"]})
    for ax, text in zip(axes[0], texts):
        for label in labels:
            pts = sorted((r["cache_fraction"], r["ppl"][text]) for r in result["rows"]
                         if r["config"] == label and "ppl" in r)
            if pts:
                ax.plot(*zip(*pts), "o-", label=label)
        ax.axhline(result["ppl_full"][text], color="black", ls=":", label="full cache")
        ax.set_yscale("log")
        ax.set_xlabel("cache fraction kept")
        ax.set_ylabel("perplexity")
        ax.set_title(f"{text} ({result['tokens']} tokens)")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
