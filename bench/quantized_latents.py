"""LoRC with quantized latents (issue #13): perplexity ratio and bits per cached K/V value of
the default model at default plan options, latents stored as ``latent_bits``-bit codes.

    OMP_NUM_THREADS=1 python bench/quantized_latents.py 0.8:4 0.8:16 0.6:4 0.5:8

Each argument is ``fraction:latent_bits`` (groups of 32 tokens per channel). The recorded
results were measured when a quantized plan's ``cache_fraction`` counted latent elements;
it now counts bytes (quantized latents fill it at a higher rank), so rerunning gives other
plans: ``bench/bits_pareto.py`` is the comparison at equal bits. Windows: 4096
evaluation tokens of news and Austen in windows of 512, each scored in one forward through a
fresh latent cache (every window is 16 whole groups, so every latent is read quantized, as
KIVI with no full-precision window). Bits per value are for a 16-bit deployment (16-bit
scales and zero points; 16 = the uncompressed cache), from the plan's byte count, RoPE angle
log included; ``measured_over_plan`` checks it against the bytes measured from the cache's
tensors in this float32 run (below 1: the batch shares one row of RoPE angles).
"""
from __future__ import annotations

import json
import sys
import time

import torch

import lorc_fx
from lorc_fx.data.texts import load_text
from lorc_fx.eval.evaluate import evaluation_windows, score_windows


def main(configs: list[str]) -> None:
    torch.set_num_threads(1)
    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    windows = {name: evaluation_windows(tokenizer, load_text(name), 4096, 512)
               for name in ("news", "austen")}
    full = {name: score_windows(model, w, False).ppl for name, w in windows.items()}
    print(json.dumps({"ppl_full": full}), flush=True)
    blocks = lorc_fx.analyze(model)
    for config in configs:
        fraction, bits = float(config.split(":")[0]), int(config.split(":")[1])
        start = time.perf_counter()
        report = lorc_fx.compress(model, fraction, latent_bits=bits, latent_group=32,
                                  blocks=blocks)
        full16, kept16 = report.plan.cache_bytes_per_token(2)
        row = {"fraction": fraction, "reached": report.plan.cache_fraction, "latent_bits": bits,
               "rope": report.plan.options.rope, "bits_per_value_16bit": 16 * kept16 / full16}
        for name, w in windows.items():
            scores = score_windows(model, w, True)
            row[name] = scores.ppl / full[name]
            row[name + "_measured_over_plan_f32"] = (scores.cache_bytes_per_token
                                                     / report.plan.cache_bytes_per_token(4)[1])
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
