"""Compress the default model, compile it with lorc_backend, generate, compare with eager.

    python bench/compiled_generate.py [--cache-fraction 0.5] [--tokens 32]

Prints cache bytes full vs compressed (measured from the cache's tensors), whether the
compiled tokens equal the eager compressed run, graph breaks and graphs compiled.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import lorc_fx  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    report = lorc_fx.compress(model, cache_fraction=args.cache_fraction)
    inputs = tokenizer("The history of the printing press begins", return_tensors="pt")
    generate = lambda: model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False,
                                      min_new_tokens=args.tokens, return_dict_in_generate=True)
    with torch.no_grad():
        start = time.perf_counter()
        eager = generate()
        eager_s = time.perf_counter() - start
        counters.clear()
        model.compile(backend=lorc_fx.lorc_backend)
        start = time.perf_counter()
        compiled = generate()
        compiled_s = time.perf_counter() - start

    uncompressed_bytes = sum(layer.k_full + layer.v_full for layer in report.plan.layers)
    cache = compiled.past_key_values
    tokens = cache.get_seq_length()
    full = uncompressed_bytes * tokens * inputs["input_ids"].shape[0] * model.dtype.itemsize
    measured = cache.cache_bytes()
    same = torch.equal(eager.sequences, compiled.sequences)
    print(f"plan: cache fraction {report.plan.cache_fraction:.4f} "
          f"({report.plan.options.schedule}, basis={report.plan.options.basis})")
    print(f"cache bytes after {tokens} tokens: full {full}, compressed {measured} "
          f"(ratio {measured / full:.4f}, measured from the cache's tensors)")
    print(f"compiled tokens equal eager compressed run: {same}")
    print(f"graph breaks: {sum(counters['graph_break'].values())}, "
          f"graphs compiled: {counters['stats']['unique_graphs']}")
    print(f"eager generate {eager_s:.1f} s, compiled generate (incl. compile) {compiled_s:.1f} s")
    print("text:", tokenizer.decode(compiled.sequences[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
