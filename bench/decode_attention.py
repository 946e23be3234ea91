"""Decode attention over the LoRC latent vs SDPA over the full KV cache, one Llama-3-8B-like layer.

    python bench/decode_attention.py [--batches 1 4 16 32] [--contexts 1024 ...] [--fractions ...]

Layer: 32 query heads, 8 KV heads, head dim 128; latent widths ``r_k = r_v = fraction * 1024``.
Per (batch, context, fraction) it times, for one decode step:

- ``sdpa``: ``scaled_dot_product_attention`` (``enable_gqa``) over the full K/V cache;
- ``latent``: ``lorc::latent_decode`` alone (the query and output already absorbed);
- ``absorbed``: the absorbed query projection + ``lorc::latent_decode`` + the per-head output
  expansion ``P_v^T``, i.e. what replaces SDPA in a model;
- ``reconstruct``: ``lorc::reconstruct_decode`` (keys rebuilt and rotated per tile).

Bandwidth: bytes of cache read / time (the latents, or the full K and V), and that as a fraction
of device copy bandwidth (a large ``clone``: bytes read + written / time). On a GPU the ops run
the Triton kernels in bfloat16 (timed with ``triton.testing.do_bench``, median); without one the
ops run their torch path in float32 on a few small shapes with one thread (the Triton interpreter
is far too slow to time). Results go to ``bench/results/decode_attention-<machine>.{json,md}``.
Everything runs eagerly, so each op call includes the custom-op dispatch (a few microseconds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads cost ~8 ms a region here

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lorc_fx.kernels  # noqa: E402,F401  (registers torch.ops.lorc)

HEADS, KV_HEADS, HEAD_DIM, ROPE_THETA = 32, 8, 128, 500000.0
RESULTS = Path(__file__).resolve().parent / "results"


def gpu_timer(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def cpu_timer(fn, min_seconds: float = 1.0) -> float:
    """Minimum milliseconds over at least ``min_seconds`` of runs after two warm-up calls (the
    minimum: these 2-core machines are shared, and other load only adds time)."""
    fn(), fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def copy_bandwidth(device: torch.device, nbytes: int, timer) -> float:
    """GB/s of a device-to-device copy of a large tensor, counting bytes read + written. Copies
    into a preallocated tensor: on CPU a ``clone`` would mostly time page faults."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    ms = timer(lambda: y.copy_(x))
    return 2 * nbytes / ms / 1e6


def orthonormal_rows(rank: int, width: int, device, dtype) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(width, rank, device=device))[0].T.contiguous().to(dtype)


class Layer:
    """Random inputs for one decode step at ``(batch, context, rank)``."""

    def __init__(self, batch: int, context: int, rank: int, device, dtype):
        g = torch.Generator(device=device).manual_seed(0)
        randn = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
        kv_width = KV_HEADS * HEAD_DIM
        self.q = randn(batch, HEADS, HEAD_DIM)
        self.k = randn(batch, KV_HEADS, context, HEAD_DIM)
        self.v = randn(batch, KV_HEADS, context, HEAD_DIM)
        self.c_k, self.c_v = randn(batch, 1, context, rank), randn(batch, 1, context, rank)
        self.p_k = orthonormal_rows(rank, kv_width, device, dtype)
        self.p_v = orthonormal_rows(rank, kv_width, device, dtype)
        group = HEADS // KV_HEADS  # per-query-head blocks of the bases: (H, d, r), (H, r, d)
        blocks_k = self.p_k.view(rank, KV_HEADS, HEAD_DIM)
        blocks_v = self.p_v.view(rank, KV_HEADS, HEAD_DIM)
        self.q_proj = blocks_k.permute(1, 2, 0).repeat_interleave(group, 0)
        self.o_proj = blocks_v.permute(1, 0, 2).repeat_interleave(group, 0)
        self.q_latent = torch.einsum("bhd,hdr->bhr", self.q, self.q_proj)
        self.positions = torch.arange(context, device=device).expand(batch, context)
        self.inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.scale = 1 / math.sqrt(HEAD_DIM)

    def sdpa(self):
        return F.scaled_dot_product_attention(self.q[:, :, None], self.k, self.v, scale=self.scale,
                                              enable_gqa=True)

    def latent(self):
        return torch.ops.lorc.latent_decode(self.q_latent, self.c_k, self.c_v, self.scale)

    def absorbed(self):
        q_latent = torch.einsum("bhd,hdr->bhr", self.q, self.q_proj)
        o = torch.ops.lorc.latent_decode(q_latent, self.c_k, self.c_v, self.scale)
        return torch.einsum("bhr,hrd->bhd", o, self.o_proj)

    def reconstruct(self):
        return torch.ops.lorc.reconstruct_decode(self.q, self.c_k, self.c_v, self.p_k,
                                                 self.positions, self.inv_freq, self.scale)


def check_gpu_kernels(device) -> dict:
    """Relative error of both Triton kernels against their float32 torch path on one shape."""
    from lorc_fx.kernels.reference import latent_decode_reference, reconstruct_decode_reference

    layer = Layer(2, 1000, 200, device, torch.bfloat16)
    c_k, c_v = layer.c_k[:, 0], layer.c_v[:, 0]
    ref_latent = latent_decode_reference(layer.q_latent[:, :, None], c_k, c_v, layer.scale,
                                         dtype=torch.float32)[:, :, 0]
    ref_recon = reconstruct_decode_reference(layer.q[:, :, None], c_k, c_v, layer.p_k,
                                             layer.positions, layer.inv_freq, layer.scale,
                                             dtype=torch.float32)[:, :, 0]
    rel = lambda out, ref: ((out.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    errors = {"latent": rel(layer.latent(), ref_latent),
              "reconstruct": rel(layer.reconstruct(), ref_recon)}
    if max(errors.values()) > 2e-2:
        raise SystemExit(f"Triton kernels disagree with the torch path: {errors}")
    return errors


def measure(batch: int, context: int, fraction: float, device, dtype, timer, copy_gbs) -> dict:
    rank = round(fraction * KV_HEADS * HEAD_DIM)
    layer = Layer(batch, context, rank, device, dtype)
    item = torch.finfo(dtype).bits // 8
    full_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * item
    latent_bytes = 2 * batch * context * rank * item
    row = dict(batch=batch, context=context, fraction=fraction, rank=rank)
    for name in ("sdpa", "latent", "absorbed", "reconstruct"):
        ms = timer(getattr(layer, name))
        gbs = (full_bytes if name == "sdpa" else latent_bytes) / ms / 1e6
        row[name] = dict(ms=ms, gb_per_s=gbs, copy_fraction=gbs / copy_gbs)
    for name in ("latent", "absorbed", "reconstruct"):
        row[f"{name}_over_sdpa"] = row[name]["ms"] / row["sdpa"]["ms"]
    del layer
    return row


def machine() -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version())
    if torch.cuda.is_available():
        import triton

        info.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), platform.processor())
        info.update(device=f"CPU: {cpu}, {os.cpu_count()} cores",
                    threads=torch.get_num_threads())
    return info


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Decode attention: LoRC latent vs SDPA",
        "",
        "One Llama-3-8B-like layer: 32 query heads, 8 KV heads, head dim 128.",
        "",
        f"Machine: {m['device']}; torch {m['torch']}"
        + (f", triton {m['triton']}" if "triton" in m else f", {m['threads']} thread(s)"),
        f"dtype {report['dtype']}; ops path: {report['path']}; copy bandwidth "
        f"{report['copy_gb_per_s']:.1f} GB/s (large tensor copy, bytes read + written); "
        f"timing: {report['timing']}.",
    ]
    if "kernel_check" in report:
        lines.append(f"Kernel check (rel. error vs float32 torch path): {report['kernel_check']}")
    lines += [
        "",
        "GB/s = cache bytes read / time (full K+V for SDPA, the two latents otherwise); "
        "%copy = that / copy bandwidth.",
        "",
        "| B | N | fraction | r | SDPA ms | SDPA %copy | latent ms | latent GB/s | latent %copy "
        "| latent/SDPA | absorbed ms | absorbed/SDPA | reconstruct ms | reconstruct/SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['fraction']} | {r['rank']} "
            f"| {r['sdpa']['ms']:.3f} | {100 * r['sdpa']['copy_fraction']:.0f}% "
            f"| {r['latent']['ms']:.3f} | {r['latent']['gb_per_s']:.1f} "
            f"| {100 * r['latent']['copy_fraction']:.0f}% | {r['latent_over_sdpa']:.2f} "
            f"| {r['absorbed']['ms']:.3f} | {r['absorbed_over_sdpa']:.2f} "
            f"| {r['reconstruct']['ms']:.3f} | {r['reconstruct_over_sdpa']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--fractions", type=float, nargs="+")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    if gpu:
        device, dtype, timer = torch.device("cuda"), torch.bfloat16, gpu_timer
        batches, contexts = [1, 4, 16, 32], [1024, 4096, 8192, 16384, 32768]
        fractions = [1.0, 0.6, 0.5, 0.3]
        copy_gbs = copy_bandwidth(device, 1 << 30, timer)
        path, timing = "Triton kernels", "triton.testing.do_bench median"
    else:
        print("No GPU present: timing the ops' torch path (float32, 1 thread) against SDPA on "
              "small shapes; Triton-interpreter shapes are skipped.")
        torch.set_num_threads(1)
        device, dtype, timer = torch.device("cpu"), torch.float32, cpu_timer
        batches, contexts, fractions = [1], [1024, 4096], [0.5, 0.3]
        copy_gbs = copy_bandwidth(device, 1 << 28, timer)
        path, timing = "torch fallback", "minimum over >= 1 s of calls (shared machine)"
    batches, contexts = args.batches or batches, args.contexts or contexts
    fractions = args.fractions or fractions

    report = dict(machine=machine(), dtype=str(dtype).removeprefix("torch."), path=path,
                  timing=timing, copy_gb_per_s=copy_gbs, rows=[])
    if gpu:
        report["kernel_check"] = check_gpu_kernels(device)
    print(f"{report['machine']['device']}: copy bandwidth {copy_gbs:.1f} GB/s")
    for batch in batches:
        for context in contexts:
            for fraction in fractions:
                row = measure(batch, context, fraction, device, dtype, timer, copy_gbs)
                report["rows"].append(row)
                print(f"B={batch:<3} N={context:<6} f={fraction:<4} r={row['rank']:<5} "
                      f"sdpa {row['sdpa']['ms']:8.3f} ms  latent {row['latent']['ms']:8.3f} ms "
                      f"({row['latent']['gb_per_s']:7.1f} GB/s, "
                      f"{100 * row['latent']['copy_fraction']:3.0f}% copy)  "
                      f"absorbed {row['absorbed']['ms']:8.3f} ms  "
                      f"reconstruct {row['reconstruct']['ms']:8.3f} ms")

    slug = re.sub(r"[^a-z0-9]+", "-", (report["machine"]["device"] if gpu else "cpu").lower())
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"decode_attention-{slug.strip('-')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {stem}.json and .md")
    return report


if __name__ == "__main__":
    main()
