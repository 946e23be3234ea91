"""``lorc demo``: the whole story on the default model in a few minutes.

Plan at a cache fraction, show the per-layer ranks and cache bytes per token, perplexity full
vs compressed on news (with next-token agreement and KL), a side-by-side greedy generation,
and compiled decode speed: the compressed model under ``lorc_backend`` against the
uncompressed one under Inductor. Both decode with a static cache, so each compiles two graphs
(prefill and one decode step).
Everything lands in a report directory as JSON and PNGs.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from lorc_fx.plan.options import PlanOptions

DECODE_PROMPT = "The history of the city begins in the early nineteenth century, when"


def _decode_tokens_per_second(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Decode speed after warm-up: (new_tokens − 1) steps over the time ``generate`` takes
    beyond producing the first token (the prefill)."""
    run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   cache_implementation="static")
    run(new_tokens)  # compiles prefill and decode graphs
    start = time.perf_counter()
    run(1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = run(new_tokens)
    total = time.perf_counter() - start
    return (new_tokens - 1) / max(total - prefill, 1e-9), out[0, ids.shape[1]:].tolist()


def plot_perplexity(ppl: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    bars = ax.bar(["full cache", f"compressed\n({ppl['cache_fraction']:.2f} kept)"],
                  [ppl["ppl_full"], ppl["ppl_compressed"]], color=["gray", "tab:blue"])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel(f"perplexity ({ppl['text']}, {ppl['tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(options: PlanOptions, out_dir: str, tokens: int = 2048, new_tokens: int = 48,
             compile_speed: bool = True, log=print) -> dict:
    from lorc_fx.analysis import analyze
    from lorc_fx.compile.backend import lorc_backend
    from lorc_fx.api import compress
    from .evaluate import EvalOptions, evaluate
    from lorc_fx.data.models import load_model, load_tokenizer
    from lorc_fx.report import plot_plan
    from lorc_fx.data.texts import load_text

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    log("lorc demo: the embedded SmolLM2-135M; plans a smaller KV cache (the plan below says "
        "what it keeps), then perplexity and a greedy continuation, full vs compressed"
        + (", and compiled decode speed" if compile_speed else "") + "\n")
    start = time.perf_counter()
    model, tokenizer = load_model("default"), load_tokenizer("default")
    blocks = analyze(model)
    seconds["load_and_analyze"] = time.perf_counter() - start

    start = time.perf_counter()
    report = compress(model, blocks=blocks, options=options)
    seconds["plan"] = time.perf_counter() - start
    log(str(report))
    full_bytes, kept_bytes = report.cache_bytes_per_token()

    start = time.perf_counter()
    result = evaluate(model, tokenizer, load_text("news"),
                      EvalOptions(tokens=tokens, prompts=1, new_tokens=new_tokens))
    seconds["evaluate"] = time.perf_counter() - start
    ppl = {"text": "news", "tokens": tokens, "cache_fraction": report.plan.cache_fraction,
           "ppl_full": result.ppl_full, "ppl_compressed": result.ppl_compressed,
           "ppl_ratio": result.ppl_ratio, "top1_agreement": result.top1_agreement,
           "kl_mean": result.kl_mean, "scoring": result.scoring}
    log(f"\nperplexity on news ({tokens} tokens; compressed {result.scoring}): full "
        f"{result.ppl_full:.2f}, compressed "
        f"{result.ppl_compressed:.2f} (x{result.ppl_ratio:.3f}); next-token agreement "
        f"{result.top1_agreement:.1%}, KL from full {result.kl_mean:.4f} nats/token")
    sample = result.generation["samples"][0]
    log(f"\nprompt: {sample['prompt']!r}\n  full cache: {sample['full']!r}\n"
        f"  compressed: {sample['compressed']!r}")

    speed = {}
    if compile_speed and not report.plan.scheme.capabilities.static_cache:
        log(f"\ncompiled decode speed skipped: a {report.plan.scheme.title} plan needs a dynamic "
            "cache (the speed test compiles a static one)")
        compile_speed = False
    if compile_speed:
        start = time.perf_counter()
        ids = tokenizer(DECODE_PROMPT, return_tensors="pt").input_ids
        baseline = load_model("default")
        baseline.compile()  # default Inductor, uncompressed
        speed["full_inductor_tokens_per_s"], _ = _decode_tokens_per_second(baseline, ids, new_tokens)
        del baseline
        model.compile(backend=lorc_backend)
        speed["compressed_lorc_tokens_per_s"], _ = _decode_tokens_per_second(model, ids, new_tokens)
        speed["threads"] = torch.get_num_threads()
        seconds["compiled_decode"] = time.perf_counter() - start
        log(f"\ncompiled decode ({new_tokens} tokens, static cache, {speed['threads']} thread(s)): "
            f"full + Inductor {speed['full_inductor_tokens_per_s']:.1f} tok/s, compressed + "
            f"lorc_backend {speed['compressed_lorc_tokens_per_s']:.1f} tok/s (a short prompt, "
            "where the model's weights dominate a step, not the cache; bench/long_context.py "
            "measures long prompts)")

    data = {"plan": report.to_json(), "cache_bytes_per_token": {"full": full_bytes,
                                                               "compressed": kept_bytes},
            "perplexity": ppl, "generation": result.generation, "decode_speed": speed,
            "seconds": seconds}
    (out / "report.json").write_text(json.dumps(data, indent=2))
    plot_plan(report.plan, str(out / "plan.png"))
    plot_perplexity(ppl, str(out / "perplexity.png"))
    log(f"\ncache bytes per token: {full_bytes} full, {kept_bytes:g} compressed; wrote "
        f"{out / 'report.json'}, {out / 'plan.png'}, {out / 'perplexity.png'}")
    return data
