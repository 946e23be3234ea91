"""How long a second compile of the default model's generate takes with Inductor's caches on
vs off, under ``lorc_backend``.

    python bench/compile_cache.py [--cache-fraction 0.6] [--tokens 8]

Each run is a fresh process (so dynamo and Inductor start cold in memory) sharing one
``TORCHINDUCTOR_CACHE_DIR``: a first run fills the on-disk caches, then a second run with the
FX graph / AOTAutograd caches on and one with them off. Prints the wall time of the first
compiled ``generate`` (compile included) and the cache hits Inductor counted, and writes
``bench/results/compile_cache-cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "compile_cache-cpu.json"


def one_run(fraction: float, tokens: int) -> dict:
    import torch
    from torch._dynamo.utils import counters

    import lorc_fx

    torch.set_num_threads(1)
    model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    # the weight basis plans in seconds; the graphs compiled are the same for any basis
    lorc_fx.compress(model, cache_fraction=fraction, basis="weight", schedule="uniform")
    inputs = tokenizer("The history of the printing press begins", return_tensors="pt")
    model.compile(backend=lorc_fx.lorc_backend)
    counters.clear()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds,
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-fraction", type=float, default=0.6)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.cache_fraction, args.tokens)))
        return
    cache_dir = tempfile.mkdtemp(prefix="lorc-inductor-")
    runs = {}
    for name, on in (("first (cold disk cache)", "1"), ("second, caches on", "1"),
                     ("second, caches off", "0")):
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache_dir,
                   TORCHINDUCTOR_FX_GRAPH_CACHE=on, TORCHINDUCTOR_AUTOGRAD_CACHE=on)
        out = subprocess.run([sys.executable, __file__, "--child", "--cache-fraction",
                              str(args.cache_fraction), "--tokens", str(args.tokens)],
                             env=env, check=True, capture_output=True, text=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {runs[name]}", flush=True)
    on, off = runs["second, caches on"]["seconds"], runs["second, caches off"]["seconds"]
    print(f"second compile + generate: caches on {on:.1f} s, off {off:.1f} s ({off / on:.2f}x)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"cache_fraction": args.cache_fraction, "tokens": args.tokens,
                                   "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
