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

``--against OLD.cpp`` times the C++ kernels of this checkout against another version of
``lorc_fx/kernels/vector_reductions.cpp`` (``git show REV:lorc_fx/kernels/vector_reductions.cpp
> OLD.cpp``) in one process: the kernels a compiled decode step calls (the keys' scores by
table, their scores turned per rotary pair under ``objective="speed"``, the values' sums, a side
decoded), each over every layer at once, the two builds alternated
call by call over ``--rounds`` rounds; their outputs must agree (scores and sums to float32
rounding, decodes bit for bit). Query rows: ``--rows`` (9: one token of the default model's
query heads; 45: five draft tokens).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lorc_fx.api import load_plan
from lorc_fx.cache.stores.vector_ops import vector_decode
from lorc_fx.codes.integer import pack_bits
from lorc_fx.codes.vector import BLOCK
from lorc_fx.kernels import vector_reductions  # registers the ops; its kernels for --against
from lorc_fx.kernels.native import build

ROTARY_PAIRS = 32  # a 64-wide head's


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


@dataclass
class _Side:
    """One side's codes as a kernel takes them (``args``), the tensors kept beside their
    pointers."""
    args: tuple
    width: int
    entries: int
    tensors: tuple


def _side(code, tokens: int, gen) -> _Side:
    payload, tables = random_codes(code, tokens, gen)
    tables = [t.float().contiguous() for t in tables]
    subs, dims, ibits, width, entries, _ = vector_reductions._layout(
        vector_reductions._shapes(tables))
    args = (vector_reductions._pointers(payload), vector_reductions._pointers(tables), subs,
            dims, ibits, len(tables))
    return _Side(args, width, entries, (payload, tables))


def kernel_calls(lib, layers, tokens: int, rows: int, gen) -> dict:
    """One call a kernel over every layer's side: name -> (call, its outputs)."""
    keys = [_side(layer.k_code, tokens, gen) for layer in layers]
    values = [_side(layer.v_code, tokens, gen) for layer in layers]
    q = [torch.randn(1, rows, side.width, generator=gen) for side in keys]
    p = torch.softmax(torch.randn(1, rows, tokens, generator=gen), -1)
    # work large enough for any version's kernels: a scores' table padded to lines of 16
    work = torch.empty(-(-rows // 16) * 16 * max(s.entries for s in keys + values) + 16)
    # keys before RoPE in a RoPE-commuting basis: each channel on one of a 64-wide head's 32
    # rotary pairs (drawn: the time does not depend on which), each slot's angles
    pairs = [torch.randint(0, ROTARY_PAIRS, (side.width,), generator=gen, dtype=torch.int32)
             for side in keys]
    ab = [torch.randn(1, rows, 2 * side.width, generator=gen) for side in keys]
    cos, sin = (torch.rand(1, tokens, ROTARY_PAIRS, generator=gen) for _ in "cs")
    outs = {"scores": [torch.empty(1, rows, tokens) for _ in keys],
            "turned": [torch.empty(1, rows, tokens) for _ in keys],
            "sums": [torch.empty(1, rows, side.width) for side in values],
            "decode": [torch.empty(1, tokens, side.width) for side in keys]}
    blocks = tokens // BLOCK

    def scores():
        for side, qs, out in zip(keys, q, outs["scores"]):
            lib.lorc_vector_scores(qs.data_ptr(), *side.args, 1, rows, side.width, blocks,
                                   out.data_ptr(), work.data_ptr(), 1)

    def turned():
        for side, a, pair, out in zip(keys, ab, pairs, outs["turned"]):
            lib.lorc_vector_turned_scores(a.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                          pair.data_ptr(), ROTARY_PAIRS, *side.args, 1, rows,
                                          side.width, blocks, out.data_ptr(), 1)

    def sums():
        for side, out in zip(values, outs["sums"]):
            lib.lorc_vector_sums(p.data_ptr(), *side.args, 1, rows, side.width, blocks,
                                 out.data_ptr(), work.data_ptr(), 1)

    def decode():
        for side, out in zip(keys, outs["decode"]):
            lib.lorc_vector_decode(*side.args, 1, side.width, blocks, out.data_ptr(), 1)

    return {"scores": (scores, outs["scores"]), "turned": (turned, outs["turned"]),
            "sums": (sums, outs["sums"]),
            "decode": (decode, outs["decode"])}


def against(args, layers) -> None:
    """This checkout's kernels against ``args.against``'s, alternated in one process."""
    libs = {"this": vector_reductions._library(), "against": vector_reductions._typed(
        build(Path(args.against), "the kernels compared against"))}
    record = {"plan": args.plan, "against": args.against, "rows": args.rows,
              "threads": torch.get_num_threads(), "machine": platform.machine(), "runs": []}
    for tokens in args.contexts:
        calls = {n: kernel_calls(lib, layers, tokens, args.rows, torch.Generator().manual_seed(0))
                 for n, lib in libs.items()}
        for kernel in ("scores", "turned", "sums", "decode"):
            for name in libs:
                calls[name][kernel][0]()
            mine, theirs = calls["this"][kernel][1], calls["against"][kernel][1]
            # sums in another order: float32 rounding of the largest terms, not of the result
            worst = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                        for a, b in zip(mine, theirs))
            agree = (all(torch.equal(a, b) for a, b in zip(mine, theirs)) if kernel == "decode"
                     else worst < 1e-5)
            if not agree:
                raise SystemExit(f"{kernel} at {tokens} tokens: the two builds disagree "
                                 f"(largest difference {worst:.2e} of the largest value)")
            ms = {name: [] for name in libs}
            for round_ in range(args.rounds):
                for name in list(libs)[round_ % 2:] + list(libs)[:round_ % 2]:
                    start = time.perf_counter()
                    calls[name][kernel][0]()
                    ms[name].append(1e3 * (time.perf_counter() - start))
            run = {"tokens": tokens, "kernel": kernel, "ms": ms,
                   "median_ms": {n: statistics.median(v) for n, v in ms.items()}}
            record["runs"].append(run)
            print(f"{tokens} tokens, {kernel} over {len(calls['this'][kernel][1])} sides: this "
                  f"{run['median_ms']['this']:.2f} ms, against {run['median_ms']['against']:.2f}"
                  f" ms (medians of {args.rounds})", flush=True)
    with Path(args.out).with_suffix(".jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--out", default="bench/results/vector_reductions-cpu")
    parser.add_argument("--against", help="another version of vector_reductions.cpp to time")
    parser.add_argument("--rows", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    plan = load_plan(args.plan)
    layers = [l for l in plan.layers if l.k_code is not None and l.v_code is not None]
    if args.against:
        return against(args, layers)
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
