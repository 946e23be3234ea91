"""LoRC's plans against transformers' ``QuantizedCache`` (quanto, HQQ), scored as ``generate``
reads the cache (issue #37: every published quality figure is decode-time).

    OMP_NUM_THREADS=1 python bench/peers_decoded.py [--texts news,poems] [--windows 4]
        [--budgets 8.5,4.5] [--plans 1.92=PLAN.safetensors] [--quanto 4,2] [--hqq 4,3,2]
        [--residual 128] [--stem peers_decoded-cpu]

Each window of 512 evaluation tokens (``evaluation_windows``: the text's evaluation part, never
calibration's; ``poems`` is the held-out genre) is fed as ``generate`` feeds it: its first
256 tokens in one forward, then one token a step (``evaluate.decoded_logits``). Scored: the
perplexity of the 256 tokens after the prompt (the first predicted by the prompt's forward,
the others by one-token steps reading the cache), against the full cache's over the same
tokens, with the mean KL divergence from the full model and the share of equal argmaxes.

- **LoRC**: ``lorc_fx.compress(model, bits_per_value=B)`` at default options, the plan's own
  latent cache (``--plans B=PATH``: that saved plan of budget ``B`` installed instead of
  planning it).
- **quanto**: ``QuantizedCache(backend="quanto", nbits=N)`` with transformers' defaults
  (groups of 64 along each channel, the last 128 tokens or fewer in full precision, the whole
  cache re-quantized each time that residual fills); ``--residual R``: R tokens instead of 128
  (a row named "residual R").
- **HQQ**: ``QuantizedCache(backend="hqq", nbits=N)`` (``pip install hqq``; its defaults as
  quanto's: groups of 64, the 128-token residual, ``--residual`` as for quanto).

Bits per value, measured on each cache after every decode step and averaged, every float
counted at 16 bits:
LoRC's from its tensors (``LatentCache.bits_per_value``); quanto's and HQQ's from the packed
data, scale and shift (zero) tensors of their quantized keys and values plus the full-precision
residual, over the values of a 16-bit cache of the same tokens (the residual fills and empties
as it decodes).

Writes ``bench/results/STEM.{json,md}``, keeping the rows of texts and methods it does not run
(the full cache's is measured again every run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers.cache_utils import DynamicCache, QuantizedCache  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.data.texts import load_text  # noqa: E402
from lorc_fx.eval.evaluate import decoded_logits, evaluation_windows, next_token_kl  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW, PROMPT = 512, 256


def tensor_bytes(t) -> int:
    """Bytes of a tensor or of a tensor subclass's inner tensors (quanto's packed codes)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _coded(coded) -> tuple[int, int]:
    """Bytes held and values stood for by one quantized tensor: quanto's (a tensor subclass of
    packed codes, scale and shift) or HQQ's (packed codes and a dict of its scale, zero, shape:
    floats counted at 16 bits)."""
    if isinstance(coded, tuple):
        packed, meta = coded
        return (tensor_bytes(packed) + 2 * (meta["scale"].numel() + meta["zero"].numel()),
                math.prod(meta["shape"]))
    return tensor_bytes(coded), coded.numel()


def quantized_bits(cache: QuantizedCache) -> float:
    """16 × bytes held (residual floats at 16 bits) / bytes of a 16-bit cache of its tokens."""
    held = values = 0
    for layer in cache.layers:
        for coded, residual in ((layer._quantized_keys, layer.keys),
                                (layer._quantized_values, layer.values)):
            coded_bytes, coded_values = _coded(coded)
            held += coded_bytes + 2 * residual.numel()
            values += coded_values + residual.numel()
    return 16 * held / (2 * values)


@torch.no_grad()
def score(model, windows: torch.Tensor, make_cache, bits_of) -> dict:
    """Decoded perplexity, KL and top-1 agreement against the full model, and the bits per
    value held, averaged over the decode steps."""
    nll = kl = same = count = 0.0
    bits = []
    for window in windows.split(1):
        full = model(window, use_cache=False).logits[:, PROMPT - 1:-1].float()
        cache = make_cache()  # its bits after every decode step: a residual that fills and
        # empties is counted as it stands then
        logits = decoded_logits(model, window, cache, PROMPT,
                                lambda: bits.append(bits_of(cache)))[:, PROMPT - 1:-1].float()
        target = window[:, PROMPT:]
        nll += float(torch.nn.functional.cross_entropy(logits[0], target[0], reduction="sum"))
        kl += float(next_token_kl(full[0], logits[0]).sum())
        same += int((full.argmax(-1) == logits.argmax(-1)).sum())
        count += target.numel()
    return dict(ppl=math.exp(nll / count), kl=kl / count, top1=same / count,
                bits_per_value=sum(bits) / len(bits) if bits[0] is not None else None)


def write(doc: dict, stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    names = {name.split()[0] for rows in doc["texts"].values() for name in rows}
    peers = ", ".join(p for key, p in (("quanto", "quanto"), ("hqq", "HQQ")) if key in names)
    against = f"transformers' QuantizedCache ({peers})" if peers else "the full cache"
    lines = [f"# Decode-time quality: LoRC against {against}", "",
             f"`python bench/peers_decoded.py` ({doc['machine']}). Each window: "
             f"{PROMPT} tokens as a prompt, then one token a step; the {WINDOW - PROMPT} "
             "tokens after the prompt scored; ratio = perplexity ÷ the full cache's on the same tokens. "
             "Method and bit counting: the script's docstring.", "",
             "| text | windows | cache | bits/value (measured) | ppl | ratio | KL (nats) | top-1 |",
             "|---|---|---|---|---|---|---|---|"]
    for text, rows in doc["texts"].items():
        full = rows["full"]["ppl"]
        for name, r in rows.items():
            bits = "16 (float32 held)" if name == "full" else f"{r['bits_per_value']:.2f}"
            lines.append(f"| {text} | {doc['windows']} | {name} | {bits} | {r['ppl']:.3f} | "
                         f"×{r['ppl'] / full:.4f} | {r['kl']:.5f} | {r['top1']:.3f} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="news,poems")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--budgets", default="8.5,4.5", help="LoRC bits per value")
    parser.add_argument("--plans", default="", help="B=PATH,...: saved plans for budgets B")
    parser.add_argument("--quanto", default="4,2", help="QuantizedCache nbits")
    parser.add_argument("--hqq", default="", help="QuantizedCache(backend='hqq') nbits")
    parser.add_argument("--residual", type=int, default=128,
                        help="the QuantizedCache residual's tokens (transformers' default 128)")
    parser.add_argument("--stem", default="peers_decoded-cpu")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    config = model.config.get_text_config(decoder=True)
    doc = dict(machine=f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
               f"{os.environ['OMP_NUM_THREADS']}, torch {torch.__version__}",
               windows=args.windows, texts={})
    earlier = RESULTS / f"{args.stem}.json"
    if earlier.exists():  # rows of other texts and methods stay (one at a time, e.g. a peer)
        doc["texts"] = json.loads(earlier.read_text())["texts"]
    saved = dict(item.split("=", 1) for item in args.plans.split(",") if item)
    plans = {}
    for budget in (float(b) for b in args.budgets.split(",") if b):
        fresh = lorc_fx.load_model("default")
        report = (lorc_fx.compress(fresh, plan=saved[f"{budget:g}"]) if f"{budget:g}" in saved
                  else lorc_fx.compress(fresh, bits_per_value=budget))
        plans[f"LoRC {budget:g} ({report.plan.scheme.title})"] = fresh
    for text in args.texts.split(","):
        windows = evaluation_windows(tokenizer, load_text(text), args.windows * WINDOW, WINDOW)
        rows = doc["texts"].setdefault(text, {})  # rows of methods not run stay
        rows["full"] = score(model, windows, lambda: DynamicCache(config=config),
                             lambda cache: None)
        for name, compressed in plans.items():
            rows[name] = score(compressed, windows, lambda m=compressed: lorc_fx.latent_cache(m),
                               lambda cache: cache.bits_per_value())
            write(doc, args.stem)
        residual = "" if args.residual == 128 else f" (residual {args.residual})"
        for backend, widths in (("quanto", args.quanto), ("hqq", args.hqq)):
            for nbits in (int(b) for b in widths.split(",") if b):
                rows[f"{backend} int{nbits}{residual}"] = score(
                    model, windows, lambda b=backend, n=nbits: QuantizedCache(
                        b, config, nbits=n, residual_length=args.residual), quantized_bits)
                write(doc, args.stem)
        print(json.dumps(rows, indent=1), flush=True)


if __name__ == "__main__":
    main()
