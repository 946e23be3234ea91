"""The peer baseline: a KIVI-style quantized full KV cache against LoRC's low-rank cache, at
matching bytes, on the project's own evaluation windows (issue #13, part 3).

    OMP_NUM_THREADS=1 python bench/kv_quant_baseline.py [--tokens 8192] [--texts news,austen]
        [--bits 8,4,3,2] [--group 64] [--residuals 128,0] [--fractions 0.5,0.28,0.25]

**KIVI-style cache** (``KiviCache``, a ``transformers`` ``Cache`` of ``KiviLayer``s, a
``DynamicLayer`` subclass): keys quantized per channel over groups of ``G`` tokens, values per
token over groups of ``G`` channels (``min(G, head_dim)``), asymmetric, ``b`` bits, scale and
zero point per group in float16. The ``R`` most recent tokens stay in full precision, as in
transformers' ``QuantizedLayer`` (``residual_length``, default 128) and KIVI; tokens leave the
window for the quantized store in whole key groups of ``G``, so the window holds between ``R``
and ``R + G - 1`` tokens once the sequence is longer than ``R`` (transformers flushes its whole
window at once, so its window holds 0..R-1 tokens; KIVI's holds up to R). The cache
fake-quantizes: ``update()`` quantizes (real packed codes, real scales), dequantizes, keeps the
dequantized values and returns the dequantized history plus the full-precision window, so
attention reads the quantized keys/values of every token, including those of the current
forward pass. It reports its true size: packed payload + scales + zero points measured from the
quantized tensors' ``nbytes``, plus the full-precision window at 16 bits per value.

**Single-forward perplexity and the window.** A window of ``N`` tokens is scored in one
forward pass, so all its queries read the same keys: positions ``[0, N - w)`` quantized and the
last ``w`` positions (``w`` = ``R`` rounded up to whole key groups, 128 for ``R=128, G=64,
N=512``) full precision. In decoding, the query at position ``t`` would see *its own* last
``R..R+G-1`` tokens at full precision; here queries before ``N - w`` see every key quantized,
including their neighbours (harsher than decoding), and the last ``w`` queries see the same
window decoding would give the last token. ``R=0`` quantizes every token (what the issue's
table measured). Bits per value are measured on the cache after each window: with ``R=128``
the window weighs 128 of 512 tokens, so the measured figure sits far above the asymptotic one
(long contexts); both are reported.

**LoRC** at matching bytes: ``lorc_fx.compress(model, cache_fraction=f)`` with default
options, scored through ``lorc_fx.eval.evaluate.score_windows(..., compressed=True)`` (a latent cache
per batch, every token reads reconstructed latents); bits per value = 16 × measured latent
cache bytes (RoPE angle log included) / full cache bytes.

"Bits per value" is against a 16-bit cache (16 = unchanged): the model runs in float32 here,
but the accounting is that of a 16-bit deployment (16-bit window, 16-bit scales and zero
points; LoRC's fraction is dtype-independent).

Writes ``bench/results/kv_quant_baseline-cpu.{json,md,png}``; results already in the JSON are
kept and not re-run (``--fresh`` starts over), so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.eval.evaluate import evaluation_windows, score_windows  # noqa: E402

from lorc_fx.codes.integer import QuantSpec, dequantize, quantize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEM = "kv_quant_baseline-cpu"
WINDOW_DTYPE_BYTES = 2  # the full-precision window, counted as a 16-bit deployment stores it
SCALE_DTYPE = torch.float16


class KiviLayer(DynamicLayer):
    """A fake-quantized KIVI-style cache layer; ``keys``/``values`` hold what attention reads
    (dequantized store + full-precision window)."""

    def __init__(self, bits: int, group: int, residual: int):
        super().__init__()
        self.bits, self.group, self.residual = bits, group, residual
        self.quantized_tokens = 0
        self.quantized_bytes = 0  # measured from the quantized tensors

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        head_dim = value_states.shape[-1]
        self.key_spec = QuantSpec.per_channel(self.bits, self.group, SCALE_DTYPE)
        self.value_spec = QuantSpec.per_token(self.bits, min(self.group, head_dim), SCALE_DTYPE)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        start = self.quantized_tokens
        flush = max(0, (keys.shape[-2] - start - self.residual) // self.group) * self.group
        if flush and self.bits < 16:
            end = start + flush
            qk = quantize(keys[..., start:end, :], self.key_spec)
            qv = quantize(values[..., start:end, :], self.value_spec)
            self.quantized_bytes += qk.nbytes + qv.nbytes
            keys = torch.cat([keys[..., :start, :], dequantize(qk), keys[..., end:, :]], dim=-2)
            values = torch.cat([values[..., :start, :], dequantize(qv), values[..., end:, :]], dim=-2)
            self.quantized_tokens = end
        self.keys, self.values = keys, values
        return keys, values

    def cache_bytes(self) -> int:
        """Quantized store (measured) + the full-precision window at 16 bits."""
        window = self.keys.numel() + self.values.numel()
        window = window * (self.keys.shape[-2] - self.quantized_tokens) // max(1, self.keys.shape[-2])
        return self.quantized_bytes + window * WINDOW_DTYPE_BYTES

    def full_bytes(self) -> int:
        return (self.keys.numel() + self.values.numel()) * WINDOW_DTYPE_BYTES

    def crop(self, tokens_to_remove):  # a crop cannot un-quantize: only the window may go
        if tokens_to_remove and self.keys.shape[-2] + tokens_to_remove < self.quantized_tokens:
            raise NotImplementedError("cropping into the quantized store")
        super().crop(tokens_to_remove)


class KiviCache(Cache):
    def __init__(self, num_layers: int, bits: int, group: int = 64, residual: int = 128):
        super().__init__(layers=[KiviLayer(bits, group, residual) for _ in range(num_layers)])

    def bits_per_value(self) -> float:
        """Measured: 16 × bytes held / bytes of a 16-bit cache of the same tokens."""
        return 16 * sum(l.cache_bytes() for l in self.layers) / sum(l.full_bytes() for l in self.layers)


def kivi_bits_asymptotic(bits: int, group: int, head_dim: int) -> float:
    k = QuantSpec.per_channel(bits, group, SCALE_DTYPE).bits_per_value()
    v = QuantSpec.per_token(bits, min(group, head_dim), SCALE_DTYPE).bits_per_value()
    return (k + v) / 2


@torch.no_grad()
def score_kivi(model, windows, bits, group, residual, batch_size=2):
    config = model.config.get_text_config(decoder=True)
    total, count, bits_seen = 0.0, 0, []
    for batch in windows.split(batch_size):
        cache = KiviCache(config.num_hidden_layers, bits, group, residual)
        logits = model(batch, past_key_values=cache, use_cache=True).logits[:, :-1].float()
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))
        count += batch[:, 1:].numel()
        bits_seen.append(cache.bits_per_value())
    return math.exp(total / count), sum(bits_seen) / len(bits_seen)


def full_cache_bytes_per_token(model) -> int:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * itemsize


def write(doc: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{STEM}.json").write_text(json.dumps(doc, indent=1) + "\n")
    rows = sorted(doc["results"], key=lambda r: (-r["bits_per_value_asymptotic"], r["method"]))
    table = {}
    for r in rows:
        table.setdefault((r["method"], r["config"]), {})[r["text"]] = r
    texts = doc["meta"]["texts"]
    lines = [f"# KIVI-style KV quantization vs LoRC low rank, {doc['meta']['tokens']} tokens per "
             f"text in windows of {doc['meta']['window']}", "",
             doc["meta"]["note"], ""]
    if doc["meta"]["tokens"] < 8192:
        lines += [f"{doc['meta']['tokens']} tokens per text, not the project's usual 8192: the "
                  "machine's 2 cores were shared with 3 other jobs, and one configuration took "
                  "about 50 s per text at this size (ratios are paired on the same windows).", ""]
    lines += [
             "| method | bits per value (long context) | bits per value (measured, 512-token windows) | "
             + " | ".join(f"{t} ratio" for t in texts) + " |",
             "|---|---|---|" + "---|" * len(texts)]
    for (method, config), per_text in table.items():
        any_r = next(iter(per_text.values()))
        cells = [f"×{per_text[t]['ratio']:.4f}" if t in per_text else "–" for t in texts]
        lines.append(f"| {method} {config} | {any_r['bits_per_value_asymptotic']:.2f} | "
                     f"{any_r['bits_per_value_measured']:.2f} | " + " | ".join(cells) + " |")
    full = {t: doc["full_ppl"][t] for t in texts if t in doc["full_ppl"]}
    lines += ["", "Uncompressed perplexity: " + ", ".join(f"{t} {p:.3f}" for t, p in full.items()),
              "", f"Machine: {doc['meta']['machine']}", ""]
    (RESULTS / f"{STEM}.md").write_text("\n".join(lines))


def plot(doc: dict) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = doc["meta"]["texts"]
    fig, axes = plt.subplots(1, len(texts), figsize=(5.5 * len(texts), 4.2), squeeze=False)
    for ax, text in zip(axes[0], texts):
        series = {}
        for r in doc["results"]:
            if r["text"] == text:
                series.setdefault(r["series"], []).append(r)
        for name, rs in sorted(series.items()):
            rs.sort(key=lambda r: r["bits_per_value_measured"])
            ax.plot([r["bits_per_value_measured"] for r in rs], [r["ratio"] for r in rs],
                    "o-", label=name)
            if name.startswith("KIVI") and "R=128" in name:  # long-context size, dashed
                ax.plot([r["bits_per_value_asymptotic"] for r in rs], [r["ratio"] for r in rs],
                        "x--", alpha=0.5, label=name + " at its long-context size")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2f"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2f"))
        ax.set_xlabel("bits per cached K/V value (16 = unchanged), measured")
        ax.set_ylabel("perplexity ratio to the uncompressed model")
        ax.set_title(text)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{STEM}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--texts", default="news,austen")
    parser.add_argument("--bits", default="8,4,3,2")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--residuals", default="128,0")
    parser.add_argument("--fractions", default="0.5,0.28,0.25")
    parser.add_argument("--order", default="kivi128,lorc,kivi0",
                        help="what to run first (kivi<R>, lorc); results are written after each")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the table and plot from the JSON, run nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.report_only:
        doc = json.loads((RESULTS / f"{STEM}.json").read_text())
        write(doc)
        plot(doc)
        return
    texts = args.texts.split(",")
    path = RESULTS / f"{STEM}.json"
    doc = json.loads(path.read_text()) if path.exists() and not args.fresh else None
    if doc and (doc["meta"]["tokens"], doc["meta"]["window"]) != (args.tokens, args.window):
        doc = None
    doc = doc or {"meta": {}, "full_ppl": {}, "results": []}
    doc["meta"] = {
        "tokens": args.tokens, "window": args.window, "texts": texts,
        "scale_dtype": "float16", "model": "default (SmolLM2-135M, float32)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                   f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch {torch.__version__}",
        "note": ("Bits per value against a 16-bit cache, everything counted (packed codes, float16 "
                 "scale and zero point per group, the full-precision window at 16 bits; LoRC: "
                 "latents and the RoPE angle log). KIVI keys per channel over groups of G "
                 "tokens, values per token over groups of G channels; R = full-precision window "
                 "of recent tokens. One forward per 512-token window: "
                 "the last R (whole key groups) positions are full precision for every query, the "
                 "rest quantized for every query, its own keys included."),
    }
    done = {(r["method"], r["config"], r["text"]) for r in doc["results"]}

    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full_bpt = full_cache_bytes_per_token(model)
    windows = {t: evaluation_windows(tokenizer, lorc_fx.load_text(t), args.tokens, args.window)
               for t in texts}

    def record(method, cfg, series, text, ppl, measured, asymptotic, seconds):
        doc["results"].append({
            "method": method, "config": cfg, "series": series, "text": text, "ppl": ppl,
            "ppl_full": doc["full_ppl"][text], "ratio": ppl / doc["full_ppl"][text],
            "bits_per_value_measured": measured, "bits_per_value_asymptotic": asymptotic,
            "seconds": seconds})
        done.add((method, cfg, text))
        write(doc)
        print(f"{method} {cfg} {text}: ppl {ppl:.3f} ×{ppl / doc['full_ppl'][text]:.4f} "
              f"bits {measured:.2f} (long context {asymptotic:.2f}) {seconds:.0f}s", flush=True)

    for text in texts:
        if text not in doc["full_ppl"]:
            start = time.perf_counter()
            doc["full_ppl"][text] = score_windows(model, windows[text], False).ppl
            print(f"full {text}: ppl {doc['full_ppl'][text]:.3f} "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
            write(doc)

    for step in args.order.split(","):
        if step.startswith("kivi"):
            residual = int(step[4:])
            if str(residual) not in args.residuals.split(","):
                continue
            for bits in map(int, args.bits.split(",")):
                method, cfg = f"KIVI int{bits}", f"G={args.group}, R={residual}"
                for text in texts:
                    if (method, cfg, text) in done:
                        continue
                    start = time.perf_counter()
                    ppl, measured = score_kivi(model, windows[text], bits, args.group, residual)
                    record(method, cfg, f"KIVI-style, R={residual}", text, ppl, measured,
                           kivi_bits_asymptotic(bits, args.group, head_dim),
                           time.perf_counter() - start)
        elif step == "lorc":
            for fraction in [float(f) for f in args.fractions.split(",") if f]:
                method, cfg = "LoRC low rank", f"fraction {fraction:g}"
                todo = [t for t in texts if (method, cfg, t) not in done]
                if not todo:
                    continue
                lorc_model = lorc_fx.load_model("default")
                start = time.perf_counter()
                lorc_fx.compress(lorc_model, cache_fraction=fraction)
                print(f"compress {fraction}: {time.perf_counter() - start:.0f}s", flush=True)
                for text in todo:
                    start = time.perf_counter()
                    scores = score_windows(lorc_model, windows[text], True)
                    bits = 16 * scores.cache_bytes_per_token / full_bpt
                    record(method, cfg, "LoRC low rank (defaults)", text, scores.ppl, bits, bits,
                           time.perf_counter() - start)
                del lorc_model
    plot(doc)


if __name__ == "__main__":
    main()
