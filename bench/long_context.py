"""Long-context decode: full cache under Inductor vs LoRC-compressed cache under lorc_backend.

    OMP_NUM_THREADS=1 python bench/long_context.py [--contexts 1024,2048,4096,8192]
        [--batches 1,8] [--new-tokens 64] [--fraction 0.5]
        [--rope auto|commute|reconstruct[:BITS][,..]] [--plans PLAN.safetensors[,..]]
        [--baselines full,full-gqa]
        [--cache static|dynamic] [--out bench/results/long_context-cpu]

Public API only (``lorc_fx.load_model/load_tokenizer/load_text/compress/lorc_backend``,
``model.compile``, ``model.generate``). Every configuration (variant × context × batch) runs
in a fresh subprocess (``--worker``), so compile caches in memory and RSS peaks are separate.
Each worker loads the default model (SmolLM2-135M, float32), either compiles it as is
(``model.compile()``: Inductor, full cache) or compresses it (``lorc_fx.compress``) and
compiles it with ``lorc_backend``, and runs ONE greedy ``generate`` with a static cache
(``cache_implementation="static"``, as ``lorc demo`` does) over ``batch`` windows of real
text (the embedded news articles) of ``context`` tokens each, for ``new_tokens`` tokens.
``--cache dynamic`` runs ``generate`` with its default cache instead (README's example as
written), every variant alike; write its results to another ``--out``.

Two full-cache baselines. ``full`` is what ``model.compile()`` gives a transformers user on
CPU: a decode step passes a mask, so transformers' SDPA integration (``use_gqa_in_sdpa``, a
rule written for CUDA kernels) does not pass ``enable_gqa`` and, under Dynamo, copies every
KV head of the whole cache once per query head it serves (``repeat_kv``: 3 × the cache per
layer and step on the default model's 9/3 heads). ``full-gqa`` sets transformers'
``TRANSFORMERS_SDPA_FORCE_GQA=1``, so the same compiled model reads the cache in place
(``enable_gqa``, which PyTorch's CPU SDPA takes with a mask: the same outputs). The goals are
judged against the faster of the two.

What is measured, and how:

- Decode speed: a ``LogitsProcessor`` stamps ``time.perf_counter()`` each time generate
  hands it the logits of a new token, i.e. once after the prefill forward and once after every
  decode forward. Step ``i``'s time is stamp ``i`` − stamp ``i−1``: one decode forward (plus
  generate's own per-token Python), prefill excluded. The first ``--warmup-steps`` decode
  steps (where Dynamo/Inductor compile the decode graph) are discarded; decode tok/s per
  sequence = timed steps / their summed time (× batch for total tok/s). The last
  ``--profile-steps`` steps run under ``torch.profiler`` and are not timed.
  "prefill_incl_compile_s" (stamp 0 − start of generate) includes compiling the prefill
  graph: it is NOT a prefill speed. "prefill_s" is the fastest of further ``generate`` calls
  of one token over the same prompt, each timed to its first stamp: up to 3 of them, fewer
  once 60 s have gone into them ("prefill_runs_s" lists them; "prefill_compiles": graphs
  Dynamo compiled during them, 0 when the prefill graph was reused).
- Attention share: ``torch.profiler`` over ``--profile-steps`` decode steps, Inductor
  kernels made visible (``torch._inductor.config.cpp.enable_kernel_profile``). Each event's
  self time (its time minus its profiled children's) is counted once; they sum to the
  profiled steps' total. An event is attention-related if an enclosing event is, or: any
  SDPA / attention / softmax / bmm op, any ``lorc::`` op (the decode attention kernels), any
  Inductor kernel fused from those, from an ``exp``
  (a softmax written out: the models here have no other), from the cache
  write (``index_copy``/``index_put``) or RoPE on cached keys, and any op one of whose input
  shapes has the static cache length as a dimension (e.g. the mm rebuilding keys from the
  latent). Share = attention self time ÷ all self time. The rule is shape/name based and
  printed with the top ops, so it can be checked.
- Cache bytes: from the tensors of the cache ``generate`` returns
  (``return_dict_in_generate=True``): every tensor reachable from the cache's layers and
  the cache object (one level down, e.g. a RoPE angle log), counted once. A static cache holds
  ``context + new_tokens`` positions.
- Memory: RSS from /proc/self/status. ``rss_load_mb`` after loading (and compressing) the
  model; ``peak_decode_mb``: the peak RSS (VmHWM, reset via /proc/self/clear_refs once the
  warm-up decode steps are done) over the timed decode steps; ``peak_process_mb``: the
  process's whole peak (``ru_maxrss``: load, compile, prefill, decode).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
PREFILL_REPEATS, PREFILL_BUDGET_S = 3, 60.0  # warm prefills timed; their fastest is reported

BASELINES = ("full", "full-gqa")  # full cache under Inductor: transformers' default; GQA in place
ATTENTION_WORDS = ("attention", "sdpa", "softmax", "bmm", "index_copy", "index_put")
MAX_POSITIONS = 8192  # SmolLM2-135M's max_position_embeddings


# ----------------------------------------------------------------------------- worker

def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cache_bytes(cache) -> int:
    """Bytes of every tensor held by the cache: a ``LatentCache`` counts its own (latents or
    codes, scales, zero points, windows, the RoPE angle log: ``LatentCache.cache_bytes``);
    any other cache, every tensor of its layers and of the cache itself (one level down into
    non-layer attributes), each storage counted once."""
    import torch

    if hasattr(cache, "cache_bytes"):
        return cache.cache_bytes()

    seen, total = set(), 0

    def add(value):
        nonlocal total
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            if key not in seen:
                seen.add(key)
                total += value.numel() * value.element_size()

    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            add(value)
    for name, value in vars(cache).items():
        if name == "layers":
            continue
        add(value)
        if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
            for inner in vars(value).values():
                add(inner)
    return total


def _prompt_ids(tokenizer, context: int, batch: int):
    import torch
    import lorc_fx

    ids = tokenizer(lorc_fx.load_text("news"), return_tensors="pt").input_ids[0]
    rows = []
    for i in range(batch):  # distinct windows of the text, wrapping around if it is too short
        start = (i * context) % max(len(ids) - context, 1)
        rows.append(ids[start:start + context])
    return torch.stack(rows)


def _is_attention(event, cache_len: int) -> bool:
    name = event.name.lower()
    if any(word in name for word in ATTENTION_WORDS):
        return True
    if "rotate" in name or "rope" in name or name.startswith("lorc::"):  # lorc's attention ops
        return True
    if name.startswith("graph_") and "_exp_" in name:  # an Inductor kernel with a softmax's exp
        return True
    return any(isinstance(shape, (list, tuple)) and cache_len in shape
               for shape in (getattr(event, "input_shapes", None) or []))


def _profile_summary(prof, cache_len: int, steps: int) -> dict:
    """Self time of every profiled CPU event, per op name; an event is attention-related if
    its own name/shapes say so or an enclosing event's do (e.g. SDPA's internal allocations)."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    verdict: dict[int, bool] = {}

    def attention(e) -> bool:
        if id(e) not in verdict:
            verdict[id(e)] = _is_attention(e, cache_len) or (
                e.cpu_parent is not None and attention(e.cpu_parent))
        return verdict[id(e)]

    by_name: dict[str, dict] = {}
    attention_us = total_us = 0.0
    for e in events:
        us, attn = e.self_cpu_time_total, attention(e)
        total_us += us
        attention_us += us if attn else 0.0
        row = by_name.setdefault(e.name, {"us": 0.0, "calls": 0, "attention_us": 0.0})
        row["us"] += us
        row["calls"] += 1
        row["attention_us"] += us if attn else 0.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:30]
    return {"attention_share": attention_us / total_us if total_us else float("nan"),
            "attention_ms_per_step": attention_us / 1e3 / steps,
            "profiled_ms_per_step": total_us / 1e3 / steps,
            "top_ops": [{"name": n, "ms_per_step": r["us"] / 1e3 / steps,
                         "calls_per_step": r["calls"] / steps,
                         "attention": r["attention_us"] >= 0.5 * r["us"] if r["us"] else False,
                         "attention_fraction": r["attention_us"] / r["us"] if r["us"] else 0.0}
                        for n, r in top]}


def _generate(model, ids, new_tokens: int, stamp, cache: str = "static"):
    """One greedy ``generate`` of exactly ``new_tokens`` with a ``cache`` cache (static, or
    ``generate``'s default dynamic one), ``stamp`` (a ``LogitsProcessor``) seeing every step;
    returns its output and its start time."""
    import torch
    from transformers import LogitsProcessorList

    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False,
                             cache_implementation=None if cache == "none" else cache,
                             logits_processor=LogitsProcessorList([stamp]),
                             return_dict_in_generate=True)
    return out, start


def _warm_prefill(model, ids, stamp, stamps, cache: str) -> tuple[list[float], int]:
    """Seconds of each repeated prefill of the same prompt (one more ``generate`` of one token
    each, its graph compiled by the first): up to ``PREFILL_REPEATS``, no more once
    ``PREFILL_BUDGET_S`` have been spent; and how many frames Dynamo compiled during them
    (0 if warm)."""
    from torch._dynamo.utils import counters

    frames = counters["stats"]["unique_graphs"]
    runs = []
    while len(runs) < PREFILL_REPEATS and sum(runs) < PREFILL_BUDGET_S:
        stamps.clear()
        _, start = _generate(model, ids, 1, stamp, cache)
        runs.append(stamps[0] - start)
    return runs, counters["stats"]["unique_graphs"] - frames


def worker(args) -> dict:
    import torch
    import torch._inductor.config as inductor_config
    from transformers import LogitsProcessor
    import lorc_fx

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    inductor_config.cpp.enable_kernel_profile = True
    record = {"variant": args.variant, "context": args.context, "batch": args.batch,
              "cache": args.cache,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "loadavg_start": os.getloadavg()}
    t0 = time.perf_counter()
    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    if args.variant in BASELINES:
        if args.variant == "full-gqa":  # read by transformers at every SDPA call it traces
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
        model.compile()  # default Inductor, full cache
    else:
        rope, _, bits = args.variant.partition(":")  # "auto", or "auto:16" (latent_bits=16)
        if rope == "plan":  # "plan:PATH": a saved plan (e.g. a low-bit one), no search
            report = lorc_fx.compress(model, plan=bits)
        else:
            report = lorc_fx.compress(model, cache_fraction=args.fraction, rope=rope,
                                      latent_bits=int(bits) if bits else "auto")
        full_bpt, kept_bpt = report.cache_bytes_per_token()
        plan = report.plan
        record.update(fraction=args.fraction, rope=plan.options.rope, kind=plan.scheme.name,
                      latent_bits=plan.options.latent_bits,
                      plan_bits_per_value=plan.bits_per_value,
                      plan_cache_fraction=report.plan.cache_fraction,
                      plan_bytes_per_token={"full": full_bpt, "compressed": kept_bpt})
        model.compile(backend=lorc_fx.lorc_backend)
    record["setup_s"] = time.perf_counter() - t0
    record["rss_load_mb"] = _rss_mb("VmRSS")

    prompt = min(args.context, MAX_POSITIONS - args.new_tokens)
    ids = _prompt_ids(tokenizer, prompt, args.batch)
    record["prompt_tokens"] = prompt
    cache_len = prompt + args.new_tokens
    n = args.new_tokens
    first_timed, last_timed = 1 + args.warmup_steps, n - 1 - args.profile_steps
    if last_timed < first_timed:
        raise SystemExit(f"--new-tokens {n} leaves no timed steps after {args.warmup_steps} "
                         f"warm-up and {args.profile_steps} profiled steps")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=True)
    stamps, peaks = [], {}

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            step = len(stamps) - 1  # 0: after prefill; i: after decode step i
            if step == first_timed - 1:
                peaks["reset"] = _reset_peak_rss()
                peaks["rss_before_decode_mb"] = _rss_mb("VmRSS")
            if step == last_timed:
                peaks["peak_decode_mb"] = _rss_mb("VmHWM")
                prof.start()
            if step == last_timed + args.profile_steps:
                prof.stop()
            return scores

    out, start = _generate(model, ids, n, Stamp(), args.cache)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    prefill_incl_compile_s = stamps[0] - start
    prefill_runs_s, prefill_compiles = _warm_prefill(model, ids, Stamp(), stamps, args.cache)
    timed = steps[first_timed - 1:last_timed]
    record.update(
        prefill_incl_compile_s=prefill_incl_compile_s,
        prefill_s=min(prefill_runs_s),
        prefill_runs_s=prefill_runs_s,
        prefill_compiles=prefill_compiles,
        warmup_steps_s=steps[:first_timed - 1],
        step_s=timed,
        decode_steps_timed=len(timed),
        decode_step_ms=1e3 * sum(timed) / len(timed),
        decode_step_median_ms=1e3 * sorted(timed)[len(timed) // 2],
        decode_tok_s_per_seq=len(timed) / sum(timed),
        decode_tok_s_total=args.batch * len(timed) / sum(timed),
        cache_len=cache_len,
        cache_bytes=_cache_bytes(out.past_key_values),
        cache_type=type(out.past_key_values).__name__,
        generated_tokens=out.sequences.shape[1] - prompt,
        peak_rss_reset=peaks.get("reset", False),
        rss_before_decode_mb=peaks.get("rss_before_decode_mb"),
        peak_decode_mb=peaks.get("peak_decode_mb"),
        peak_process_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        profile=_profile_summary(prof, cache_len, args.profile_steps),
        loadavg_end=os.getloadavg(),
        sample=tokenizer.decode(out.sequences[0, prompt:prompt + 16]),
    )
    return record


# ----------------------------------------------------------------------------- driver

def _key(r: dict) -> tuple:
    return (r["variant"], r["context"], r["batch"])


def _run_config(args, variant: str, context: int, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--context", str(context),
           "--batch", str(batch), "--new-tokens", str(args.new_tokens),
           "--fraction", str(args.fraction), "--warmup-steps", str(args.warmup_steps),
           "--profile-steps", str(args.profile_steps), "--cache", args.cache]
    print(f"\n=== {variant} context={context} batch={batch}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
        return {"variant": variant, "context": context, "batch": batch, "error":
                (proc.stderr or proc.stdout)[-2000:], "wall_s": wall}
    record = json.loads(lines[-1][len("RESULT "):])
    record["wall_s"] = wall
    p = record["profile"]
    print(f"  decode {record['decode_step_ms']:.1f} ms/step ({record['decode_tok_s_total']:.1f} "
          f"tok/s total), attention {p['attention_share']:.1%}, cache "
          f"{record['cache_bytes'] / 2**20:.1f} MiB, peak decode {record['peak_decode_mb']:.0f} MB, "
          f"process peak {record['peak_process_mb']:.0f} MB, prefill+compile "
          f"{record['prefill_incl_compile_s']:.1f} s, warm prefill {record['prefill_s']:.1f} s "
          f"({record['prefill_compiles']} graphs compiled in it), wall {wall:.0f} s", flush=True)
    for op in p["top_ops"][:8]:
        print(f"    {op['ms_per_step']:8.2f} ms/step {'A' if op['attention'] else ' '} {op['name']}")
    return record


def _ratios(results: list[dict], fraction: float) -> list[dict]:
    """One row per LoRC run and full-cache baseline measured at its context and batch."""
    full = {(r["variant"], r["context"], r["batch"]): r for r in results
            if r["variant"] in BASELINES and "error" not in r}
    rows = []
    for r, baseline in itertools.product(results, BASELINES):
        f = full.get((baseline, r["context"], r["batch"]))
        if r["variant"] in BASELINES or "error" in r or f is None:
            continue
        rows.append({
            "rope": _choice(r), "baseline": baseline,
            "context": r["context"], "batch": r["batch"],
            "decode_tok_s_full": f["decode_tok_s_total"], "decode_tok_s_lorc": r["decode_tok_s_total"],
            "decode_speed_ratio": r["decode_tok_s_total"] / f["decode_tok_s_total"],
            "attention_share_full": f["profile"]["attention_share"],
            "attention_share_lorc": r["profile"]["attention_share"],
            "cache_bytes_ratio": r["cache_bytes"] / f["cache_bytes"],
            "peak_decode_ratio": r["peak_decode_mb"] / f["peak_decode_mb"],
            "peak_decode_minus_load_ratio": (r["peak_decode_mb"] - r["rss_load_mb"])
            / (f["peak_decode_mb"] - f["rss_load_mb"]),
            "peak_process_ratio": r["peak_process_mb"] / f["peak_process_mb"],
            # attention by difference: what LoRC's step spends beyond the full model's
            # non-attention time (weights, norms, overhead: the same work in both)
            "attention_ms_full": f["decode_step_ms"] * f["profile"]["attention_share"],
            "attention_ms_lorc_by_difference": r["decode_step_ms"]
            - f["decode_step_ms"] * (1 - f["profile"]["attention_share"]),
            "prefill_s_full": f.get("prefill_s"), "prefill_s_lorc": r.get("prefill_s"),
            "prefill_speed_ratio": (f["prefill_s"] / r["prefill_s"]
                                    if f.get("prefill_s") and r.get("prefill_s") else None),
        })
    return sorted(rows, key=lambda x: (x["rope"], x["baseline"], x["batch"], x["context"]))


def _choice(r: dict) -> str:
    """The variant asked and, where it differs, what the planner chose."""
    if r.get("kind") == "plain":
        return f"{r['variant']} → plain int{r['latent_bits']}"
    if r.get("kind") == "keys_waterfilled":
        return f"{r['variant']} → keys water-filled, int{r['latent_bits']} values"
    bits = r.get("latent_bits", 16)
    chose = r.get("rope", r["variant"]) + ("" if bits == 16 else f", int{bits} latents")
    return r["variant"] if chose == r["variant"].partition(":")[0] else f"{r['variant']} → {chose}"


def _plot(results: list[dict], path: str) -> None:
    """Grouped bars: one group per (batch, prompt) configuration, one bar per variant."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    configs = sorted({(r["batch"], r["context"]) for r in ok})
    variants = list(dict.fromkeys(r["variant"] for r in sorted(ok, key=lambda r: r["variant"] not in BASELINES)))
    palette = iter(("tab:green", "tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink"))
    baseline_styles = {"full": ("silver", "full cache, Inductor (transformers' repeat_kv)"),
                       "full-gqa": ("dimgray", "full cache, Inductor, GQA in place")}
    styles = {v: baseline_styles.get(v) or (next(palette), f"LoRC {v}") for v in variants}
    panels = [("decode tok/s (all sequences)", lambda r: r["decode_tok_s_total"]),
              ("attention share of a decode step", lambda r: r["profile"]["attention_share"]),
              ("cache MiB (measured from tensors)", lambda r: r["cache_bytes"] / 2**20),
              ("peak RSS during decode (MB)", lambda r: r["peak_decode_mb"])]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / max(len(variants), 1)
    for ax, (label, value) in zip(axes.flat, panels):
        for j, variant in enumerate(variants):
            color, name = styles[variant]
            xs, ys = [], []
            for i, (batch, context) in enumerate(configs):
                run = [r for r in ok if (r["variant"], r["batch"], r["context"]) == (variant, batch, context)]
                if run:
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    ys.append(value(run[0]))
            bars = ax.bar(xs, ys, width, color=color, label=name)
            ax.bar_label(bars, fmt=lambda v: f"{v:.3g}" if v < 1000 else f"{v:.0f}", fontsize=6,
                         rotation=90, padding=2)
        ax.set_xticks(range(len(configs)), [f"{b} × {c}" for b, c in configs], fontsize=8)
        ax.set_xlabel("batch × prompt tokens", fontsize=8)
        ax.margins(y=0.15)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(variants), fontsize=8)
    fig.suptitle("SmolLM2-135M, CPU, 1 thread (2 shared cores): full cache (Inductor) vs LoRC at "
                 "cache fraction 0.5 (lorc_backend), one run each", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _markdown(data: dict) -> str:
    rows = data["ratios"]
    lines = [
        "# Long-context decode, CPU: LoRC (lorc_backend) ÷ full cache (Inductor)", "",
        f"One run per configuration; machine: {data['machine']}. Model: SmolLM2-135M (float32), "
        f"cache fraction {data['fraction']}, {data.get('cache', 'static')} cache, {data['new_tokens']} new tokens, greedy. "
        "Ratios are compressed ÷ full for the same context and batch "
        "(speed > 1: LoRC faster; memory < 1: LoRC smaller). How each number is measured: "
        "docstring of `bench/long_context.py`; baseline `full` is transformers' compiled decode "
        "(`repeat_kv` copies of the cache), `full-gqa` the same with `TRANSFORMERS_SDPA_FORCE_GQA=1` "
        "(the cache read in place).", "",
        "| rope | baseline | batch | prompt | decode tok/s full → LoRC | speed ratio | attention share full → LoRC "
        "| cache bytes ratio | peak RSS (decode) ratio | (peak − load RSS) ratio | process peak ratio "
        "| prefill s full → LoRC | prefill speed ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['rope']} | {r['baseline']} | {r['batch']} | {r['context']} | {r['decode_tok_s_full']:.1f} → "
            f"{r['decode_tok_s_lorc']:.1f} | **{r['decode_speed_ratio']:.2f}** | "
            f"{r['attention_share_full']:.0%} → {r['attention_share_lorc']:.0%} | "
            f"{r['cache_bytes_ratio']:.3f} | {r['peak_decode_ratio']:.2f} | "
            f"{r['peak_decode_minus_load_ratio']:.2f} | {r['peak_process_ratio']:.2f} | "
            f"{_num(r['prefill_s_full'], '.1f')} → {_num(r['prefill_s_lorc'], '.1f')} | "
            f"{_num(r['prefill_speed_ratio'], '.2f')} |")
    lines += ["", "Attention time per decode step, LoRC by difference (its step time minus the full "
              "model's non-attention time, as the profiler's shape rule misses the mm that rebuilds "
              "keys from the latent), against #14's goal of at most 1.2 × cache bytes ratio × full "
              "attention time:", "",
              "| rope | baseline | batch | prompt | full attention ms | LoRC attention ms | ratio | goal ≤ |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["attention_ms_lorc_by_difference"] / r["attention_ms_full"]
        lines.append(f"| {r['rope']} | {r['baseline']} | {r['batch']} | {r['context']} | {r['attention_ms_full']:.0f} | "
                     f"{r['attention_ms_lorc_by_difference']:.0f} | {ratio:.2f} | "
                     f"{1.2 * r['cache_bytes_ratio']:.2f} |")
    lines += ["", "Absolute numbers per run (decode ms/step; tok/s over all sequences; cache MiB; "
              "peak RSS during decode MB; prefill+compile s, which includes compiling):", "",
              "| variant | batch | prompt | ms/step | tok/s | attention share | cache MiB | peak decode MB "
              "| process peak MB | prefill+compile s | load avg (1 min) start/end |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if "error" in r:
            continue
        lines.append(
            f"| {r['variant']} | {r['batch']} | {r['prompt_tokens']} | {r['decode_step_ms']:.1f} | "
            f"{r['decode_tok_s_total']:.2f} | {r['profile']['attention_share']:.0%} | "
            f"{r['cache_bytes'] / 2**20:.1f} | {r['peak_decode_mb']:.0f} | {r['peak_process_mb']:.0f} | "
            f"{r['prefill_incl_compile_s']:.0f} | {r.get('loadavg_start', [float('nan')])[0]:.1f}/"
            f"{r.get('loadavg_end', [float('nan')])[0]:.1f} |")
    for r in sorted((r for r in data["results"] if "error" not in r),
                    key=lambda r: (r["variant"] != "reconstruct", r["variant"], -r["context"], r["batch"])):
        variant, p = r["variant"], r["profile"]
        lines += ["", f"Top ops (self time) of a {variant} decode step, prompt {r['prompt_tokens']}, "
                  f"batch {r['batch']} (torch.profiler over {data.get('profile_steps', 4)} steps; "
                  f"{p.get('profiled_ms_per_step', 0):.1f} ms/step profiled; A = counted as attention):", "",
                  "| ms/step | calls/step | A | op |", "|---|---|---|---|"]
        for op in p["top_ops"][:10]:
            lines.append(f"| {op['ms_per_step']:.2f} | {op['calls_per_step']:.0f} | "
                         f"{'A' if op['attention'] else ''} | `{op['name'][:110]}` |")
    errors = [r for r in data["results"] if "error" in r]
    if errors:
        lines += ["", "Failed configurations: " + ", ".join(
            f"{r['variant']} {r['context']}×{r['batch']}" for r in errors)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--rope", default="auto",
                        help="auto|commute|reconstruct, each with :BITS to fix latent_bits (default "
                             "auto: the planner's choice), or a comma list (e.g. auto,auto:16)")
    parser.add_argument("--plans", default="",
                        help="saved plan files (comma list, e.g. a low-bit plan's report.save), "
                             "each a variant 'plan:PATH' run as compress(model, plan=PATH)")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache baselines")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help="full-cache baselines to run (docstring): full, full-gqa or both")
    parser.add_argument("--warmup-steps", type=int, default=8,
                        help="decode steps discarded (decode-graph compile)")
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--cache", choices=("static", "dynamic", "none"), default="static",
                        help="generate's cache for every variant; none: generate chooses (dynamic "
                             "for the full model, static for a compressed one compiled in place)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "long_context-cpu"),
                        help="writes OUT.json, OUT.png, OUT.md; merges with an existing OUT.json")
    parser.add_argument("--machine", default=f"{os.cpu_count()} cores, OMP_NUM_THREADS="
                        f"{os.environ.get('OMP_NUM_THREADS')}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_suffix(".json")
    previous = json.loads(json_path.read_text())["results"] if json_path.exists() else []
    results = {_key(r): r for r in previous}
    variants = ([] if args.no_full else args.baselines.split(",")) + [
        r for r in args.rope.split(",") if r]
    variants += [f"plan:{path}" for path in args.plans.split(",") if path]
    for batch in (int(b) for b in args.batches.split(",")):
        # a context past the model's positions runs (and is keyed) as the longest prompt it takes
        for context in dict.fromkeys(min(int(c), MAX_POSITIONS - args.new_tokens)
                                     for c in args.contexts.split(",")):
            for variant in variants:
                record = _run_config(args, variant, context, batch)
                results[_key(record)] = record
                data = {"machine": args.machine, "fraction": args.fraction, "cache": args.cache,
                        "new_tokens": args.new_tokens, "profile_steps": args.profile_steps,
                        "warmup_steps": args.warmup_steps,
                        "results": sorted(results.values(), key=lambda r: (r["batch"], r["context"], r["variant"]))}
                data["ratios"] = _ratios(data["results"], args.fraction)
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(json.dumps(data, indent=1))
                out.with_suffix(".md").write_text(_markdown(data))
                _plot(data["results"], str(out.with_suffix(".png")))
    print(f"\nwrote {json_path}, {out.with_suffix('.png')}, {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
