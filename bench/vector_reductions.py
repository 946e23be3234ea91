"""Decode attention's reductions over a vector plan's codes, one layer at a time: the kernels
``lorc::vector_scores`` / ``vector_sums`` against decoding the codes and multiplying (what a
decode step did before them), and SDPA over the full cache of the same layer.

    OMP_NUM_THREADS=1 python bench/vector_reductions.py PLAN.safetensors [--contexts 4096 8192]
        [--out bench/results/vector_reductions-cpu]

The plan gives each layer's layouts (runs of sub-vectors, widths, index bits) and tables; the
indices are random (the time does not depend on them). One query token: ``h`` rows (the
query heads) against the shared latent. ``sdpa``: ``scaled_dot_product_attention`` of the
same query heads over float32 keys and values of the layer's full width (``enable_gqa``).
Each figure is the median of 20 calls after one, summed over the plan's layers.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lorc_fx.api import load_plan
from lorc_fx.cache.stores.vector_ops import vector_decode
from lorc_fx.codes.integer import pack_bits
from lorc_fx.codes.vector import BLOCK
from lorc_fx.kernels import vector_reductions  # noqa: F401  (registers the ops)


def median_ms(fn, calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e3


def random_codes(book, tokens: int, gen):
    payload = [pack_bits(torch.randint(0, 1 << ib, (1, subs, tokens // BLOCK, BLOCK),
                                       generator=gen), ib).flatten(-2)
               for _, subs, _, ib in book.spec.layout()]
    return payload, list(book.reconstructions)


def layer_times(layer, heads: int, head_dim: int, tokens: int, gen) -> dict[str, float]:
    keys, values = (random_codes(code, tokens, gen) for code in (layer.k_code, layer.v_code))
    q = torch.randn(1, heads, layer.k_code.spec.width, generator=gen)
    p = torch.softmax(torch.randn(1, heads, tokens, generator=gen), -1)
    full_q = torch.randn(1, heads, 1, head_dim, generator=gen)
    k, v = (torch.randn(1, layer.num_kv_heads, tokens, head_dim, generator=gen) for _ in "kv")
    return {
        "kernel scores": median_ms(lambda: torch.ops.lorc.vector_scores(q, *keys)),
        "kernel sums": median_ms(lambda: torch.ops.lorc.vector_sums(p, *values)),
        "decoded scores": median_ms(lambda: q @ vector_decode(*keys).transpose(1, 2)),
        "decoded sums": median_ms(lambda: p @ vector_decode(*values)),
        "sdpa": median_ms(lambda: F.scaled_dot_product_attention(full_q, k, v, enable_gqa=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--out", default="bench/results/vector_reductions-cpu")
    args = parser.parse_args()
    plan = load_plan(args.plan)
    layers = [l for l in plan.layers if l.k_code is not None and l.v_code is not None]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in args.contexts:
        total: dict[str, float] = {}
        for layer in layers:
            for name, ms in layer_times(layer, layer.num_heads, layer.head_dim, tokens,
                                        gen).items():
                total[name] = total.get(name, 0.0) + ms
        rows.append({"tokens": tokens, **total})
        print(tokens, {k: round(v, 2) for k, v in total.items()}, flush=True)
    machine = f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"plan": args.plan, "rope": plan.options.rope, "layers": len(layers),
         "machine": machine, "rows": rows}, indent=1))
    lines = [f"# Vector codes' decode reductions, summed over {len(layers)} layers "
             f"({Path(args.plan).name}, rope={plan.options.rope}; {machine})", "",
             "| tokens | kernel scores ms | kernel sums ms | decoded scores ms | decoded sums ms | "
             "full-cache SDPA ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['kernel scores']:.1f} | {r['kernel sums']:.1f} | "
              f"{r['decoded scores']:.1f} | {r['decoded sums']:.1f} | {r['sdpa']:.1f} |"
              for r in rows]
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
