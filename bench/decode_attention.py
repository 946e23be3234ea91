"""One decode step of attention over each cache scheme the planner picks, against SDPA over the
16-bit cache, on a Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head dim 128).

    python bench/decode_attention.py [--batches 1 8 16] [--contexts 4096 8192 16384 32768]
        [--schemes sdpa int8 int4 latent4 latent16 vector] [--out STEM] [--smoke]

Per (batch, context), one query token against ``context`` cached tokens:

- ``sdpa``: ``scaled_dot_product_attention`` (``enable_gqa``) over the 16-bit K/V cache, the
  flash backend on a GPU (the report names the backend that ran);
- ``int8`` / ``int4``: a plain plan (keys per channel in groups of 64 tokens, values per token
  in groups of 64 channels, 16-bit scales and zero points: 8.5 / 4.5 bits a value) read by
  ``compile.quantized_attention.quantized_kv_attention``;
- ``latent4``: 4-bit post-RoPE latents (per channel, groups of 32 tokens) at the rank that
  makes 2.56 bits a value, read by ``quantized_latent_attention`` (bases absorbed);
- ``latent16``: 16-bit latents of half the K/V width through ``latent_attention``, whose
  decode step on CUDA is the Triton kernel ``lorc::latent_decode``;
- ``vector``: 2.5-bit vector codes of full-width latents (``codes.vector``, what the
  planner picks below 4.5 bits), read by ``quantized_latent_attention`` as a compiled decode
  step reads them: ``lorc::vector_scores`` / ``vector_sums`` (by codebook table; a C++ kernel
  on CPU, Triton kernels on CUDA, the codes decoded and multiplied elsewhere).

The code-reading schemes (int8, int4, latent4) are traced with ``make_fx`` and compiled by
Inductor, as ``lorc_backend`` compiles the functions it puts in place of SDPA, once per shape
(their side arguments are static); each compiled result is checked against the same function
run eagerly. Sides are whole static buffers of codes (no full-precision window), as a static
cache hands them over.

Bandwidth: ``GB/s`` = bytes the scheme reads from the cache (codes, scales and zero points, or
latents, or K and V) / time; ``%copy`` = that / a large device-to-device copy's bandwidth
(bytes read + written / time). On a GPU: bfloat16, ``triton.testing.do_bench`` (median, L2
flushed between calls). On a CPU: float32, one thread, the minimum over repeated calls.
``--smoke`` runs the same code on a toy layer (4/2 heads, head dim 64) at toy contexts with the
compiled schemes run as traced (no Inductor): the GPU suite's ``--cpu-smoke``.

Shapes run in priority order (batch >= 8 at >= 8k first, the goals of issue #39), and the report
is rewritten after every row, so a run cut short keeps what it measured:
``STEM.json`` and ``STEM.md`` (default ``bench/results/decode_attention-<machine>``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads cost ~8 ms a region here

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lorc_fx.codes import vector as vector_codes  # noqa: E402
from lorc_fx.codes.integer import QuantSpec, quantize  # noqa: E402
from lorc_fx.compile.latent_attention import latent_attention  # noqa: E402
from lorc_fx.compile.quantized_attention import (VECTOR, quantized_kv_attention,  # noqa: E402
                                                 quantized_latent_attention)

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMES = ("sdpa", "int8", "int4", "latent4", "latent16", "vector")
COMPILED = ("int8", "int4", "latent4")
PLAIN_GROUP, LATENT_GROUP = 64, 32  # the planner's: plain plans at 8.5 / 4.5 bits, latents
LATENT4_BITS, VECTOR_BITS = 2.56, 2.5  # bits per cached value of the low-bit schemes
LAYERS = {"llama3-8b": (32, 8, 128), "toy": (4, 2, 64)}  # query heads, KV heads, head dim
CHECKED_TOKENS = 1 << 16  # batch × context up to which compiled results are checked


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


def coded_side(x: torch.Tensor, spec: QuantSpec):
    """``x (b, h, n, w)`` quantized as a static cache hands a side to the absorb pass:
    ``((payload, scale, zero, bits, group, axis, length, width, dtype), None, None)``, the
    tensors contiguous as the cache stores them."""
    q = quantize(x, spec)
    axis = -2 if spec.axis % 4 == 2 else -1
    codes = (q.payload.contiguous(), q.scale.contiguous(), q.zero.contiguous(), spec.bits,
             spec.group, axis, x.shape[2], x.shape[3], x.dtype)
    return codes, None, None


def side_tensors(side) -> list[torch.Tensor]:
    return list(side[0][:3])


def with_tensors(side, tensors):
    """``side`` with its payload, scale and zero point replaced (the traced inputs)."""
    codes, window, tokens = side
    return (*tensors, *codes[3:]), window, tokens


def latent4_rank(kv_width: int) -> int:
    """The rank (a multiple of 8) whose 4-bit codes, with a 16-bit scale and zero point per
    ``LATENT_GROUP`` tokens, cost ``LATENT4_BITS`` per full K/V value."""
    per_value = 4 + 2 * 16 / LATENT_GROUP
    return max(8, int(LATENT4_BITS / per_value * kv_width) // 8 * 8)


def vector_side(batch: int, n: int, width: int, device, dtype, gen):
    """Random ``VECTOR_BITS`` codes of a ``(batch, n, width)`` latent and a random book of the
    layout ``vector_codes`` fits (timing does not depend on the values)."""
    spec = vector_codes.VectorSpec(((width, VECTOR_BITS),))
    (_, subs, d, index_bits), = spec.layout()
    tables = tuple(torch.randn(subs, 1 << index_bits, d, generator=gen, device=device).to(dtype)
                   for _ in range(2))
    book = vector_codes.VectorBook(spec, (tables,))
    blocks = -(-n // vector_codes.BLOCK)
    payload = torch.randint(0, 256, (batch, subs, blocks * index_bits), generator=gen,
                            device=device, dtype=torch.uint8)
    return vector_codes.VectorCodes(spec, (payload,), n), book


class Layer:
    """One decode step's inputs at ``(batch, context)`` for every scheme asked, and its calls
    (``calls``; a scheme whose set-up failed, e.g. out of memory, has its error in
    ``errors`` instead)."""

    def __init__(self, shape: tuple[int, int, int], batch: int, context: int, schemes, device,
                 dtype, compile_fn):
        heads, self.kv_heads, head_dim = shape
        self.batch, self.context, self.device, self.dtype = batch, context, device, dtype
        self.compile_fn, self.kv_width = compile_fn, self.kv_heads * head_dim
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.scale = 1 / math.sqrt(head_dim)
        self.scale_dtype = dtype if dtype.itemsize == 2 else torch.float16
        self.q = self.randn(batch, heads, 1, head_dim)
        self.calls, self.bytes, self.eager, self.errors = {}, {}, {}, {}
        for name in schemes:
            try:
                getattr(self, f"_set_up_{name}")()
            except Exception as error:  # the other schemes still run
                self.errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device).to(self.dtype)

    def raw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The uncompressed keys and values ``(b, h_kv, n, d)``, made once."""
        if not hasattr(self, "kv"):
            d = self.kv_width // self.kv_heads
            self.kv = tuple(self.randn(self.batch, self.kv_heads, self.context, d) for _ in "kv")
        return self.kv

    def _compiled(self, name: str, fn, sides):
        """``fn(q, *the sides' tensors)`` traced and compiled; its eager run kept to check it
        where that is cheap (its reductions materialise a float32 copy of the codes per query
        head)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        inputs = [self.q, *side_tensors(sides[0]), *side_tensors(sides[1])]
        compiled = self.compile_fn(make_fx(fn)(*inputs), inputs)
        self.calls[name] = lambda: compiled(*inputs)
        if self.batch * self.context <= CHECKED_TOKENS:
            self.eager[name] = lambda: fn(*inputs)
        self.bytes[name] = sum(t.nbytes for t in inputs[1:])

    def _set_up_sdpa(self):
        k, v = self.raw()
        self.calls["sdpa"] = lambda: F.scaled_dot_product_attention(
            self.q, k, v, scale=self.scale, enable_gqa=True)
        self.bytes["sdpa"] = k.nbytes + v.nbytes

    def _set_up_plain(self, bits: int):
        k, v = self.raw()
        sides = (coded_side(k, QuantSpec.per_channel(bits, PLAIN_GROUP, self.scale_dtype)),
                 coded_side(v, QuantSpec.per_token(bits, PLAIN_GROUP, self.scale_dtype)))
        self._compiled(f"int{bits}", lambda q, *t: quantized_kv_attention(
            q, with_tensors(sides[0], t[:3]), with_tensors(sides[1], t[3:]), scale=self.scale),
            sides)

    def _set_up_int8(self):
        self._set_up_plain(8)

    def _set_up_int4(self):
        self._set_up_plain(4)

    def _set_up_latent4(self):
        rank = latent4_rank(self.kv_width)
        p_k, p_v = (orthonormal_rows(rank, self.kv_width, self.device, self.dtype) for _ in "kv")
        spec = QuantSpec.per_channel(4, LATENT_GROUP, self.scale_dtype)
        sides = tuple(coded_side(self.randn(self.batch, 1, self.context, rank), spec)
                      for _ in "kv")
        self._compiled("latent4", lambda q, *t: quantized_latent_attention(
            q, with_tensors(sides[0], t[:3]), with_tensors(sides[1], t[3:]), p_k, p_v,
            self.kv_heads, scale=self.scale), sides)

    def _set_up_latent16(self):
        rank = self.kv_width // 2
        bases = [orthonormal_rows(rank, self.kv_width, self.device, self.dtype) for _ in "kv"]
        latents = [self.randn(self.batch, 1, self.context, rank) for _ in "kv"]
        self.calls["latent16"] = lambda: latent_attention(self.q, *latents, *bases,
                                                          self.kv_heads, scale=self.scale)
        self.bytes["latent16"] = sum(c.nbytes for c in latents)

    def _set_up_vector(self):
        bases = [orthonormal_rows(self.kv_width, self.kv_width, self.device, self.dtype)
                 for _ in "kv"]
        coded = [vector_side(self.batch, self.context, self.kv_width, self.device, self.dtype,
                             self.gen) for _ in "kv"]
        window = self.randn(self.batch, 1, 0, self.kv_width)  # a static cache's: no rows
        sides = [(VECTOR, list(codes.payload), list(book.reconstructions), window, self.context,
                  self.context, None, None) for codes, book in coded]
        self.calls["vector"] = lambda: quantized_latent_attention(
            self.q, *sides, *bases, self.kv_heads, scale=self.scale)
        self.bytes["vector"] = sum(codes.nbytes for codes, _ in coded)


def output(result):
    """A compiled function's output (Inductor returns a list)."""
    return result[0] if isinstance(result, (list, tuple)) else result


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def sdpa_backend(device, shape, dtype) -> tuple[str, object]:
    """The flash SDPA backend on a GPU where it takes a decode call of this layer (a function
    making the context manager to run SDPA in: each ``sdpa_kernel(...)`` enters once), else
    torch's own choice (``None``)."""
    if device.type != "cuda":
        return "default (CPU)", None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads, head_dim = shape
    q = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)
    kv = torch.randn(1, kv_heads, 64, head_dim, device=device, dtype=dtype)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except RuntimeError as error:
        return f"default (flash refused: {str(error).splitlines()[0][:100]})", None
    return "flash", partial(sdpa_kernel, SDPBackend.FLASH_ATTENTION)


def measure(layer: Layer, schemes, timer, copy_gbs: float, values: int, sdpa_context) -> dict:
    """Each scheme's time, bandwidth and check, or its error."""
    row = {name: dict(error=error) for name, error in layer.errors.items()}
    for name in layer.calls:
        call = layer.calls[name]
        if name == "sdpa" and sdpa_context is not None:
            call = in_context(call, sdpa_context)
        try:
            ms = timer(call)
            gbs = layer.bytes[name] / ms / 1e6
            entry = dict(ms=ms, bytes=layer.bytes[name], gb_per_s=gbs,
                         copy_fraction=gbs / copy_gbs,
                         bits_per_value=8 * layer.bytes[name] / values)
            if name in layer.eager:
                entry["rel_err_vs_eager"] = rel_err(output(call()), layer.eager[name]())
        except Exception as error:  # e.g. out of memory: the other schemes still run
            entry = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        row[name] = entry
    if "ms" in row.get("sdpa", {}):
        for entry in row.values():
            if "ms" in entry:
                entry["over_sdpa"] = entry["ms"] / row["sdpa"]["ms"]
    return {name: row[name] for name in schemes if name in row}


def in_context(fn, context):
    """``fn`` run inside a fresh ``context()`` at every call."""
    def run():
        with context():
            return fn()
    return run


def priority(shape: tuple[int, int], goal: tuple[int, int]) -> tuple:
    """Goal shapes first (longest and largest first), then the rest largest first."""
    batch, context = shape
    return (not (batch >= goal[0] and context >= goal[1]), -context, -batch)


def machine(device) -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version())
    if device.type == "cuda":
        import triton

        info.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), platform.processor())
        info.update(device=f"CPU: {cpu}, {os.cpu_count()} cores", threads=torch.get_num_threads())
    return info


NOTES = {
    "sdpa": "SDPA over the K/V cache in the model's dtype (16-bit on a GPU)",
    "int8": "plain 8-bit KV codes, read by quantized_kv_attention (compiled)",
    "int4": "plain 4-bit KV codes, read by quantized_kv_attention (compiled)",
    "latent4": f"4-bit latents ({LATENT4_BITS} bits a value), read by "
               "quantized_latent_attention (compiled)",
    "latent16": "16-bit latents of half the width, latent_attention (lorc::latent_decode on CUDA)",
    "vector": f"{VECTOR_BITS}-bit vector codes read by table (lorc::vector_scores/_sums: C++ "
              "on CPU, Triton on CUDA)",
}
# issue #39's goals at batch >= 8 and >= 8k tokens (``--smoke``: its own toy shape): time
# against SDPA's, per scheme
GOAL_SHAPE = (8, 8192)
GOAL_RATIO = {"int8": 0.6, "latent4": 0.25, "vector": 0.25}
GOAL_COPY = 0.7  # of the copy bandwidth, every code-reading scheme


def goal_lines(report: dict) -> list[str]:
    """Each goal shape's verdict: the code-reading schemes' share of the copy bandwidth and
    their time against SDPA's."""
    lines, (batch, context) = [], report["goal_shape"]
    for r in report["rows"]:
        if not (r["batch"] >= batch and r["context"] >= context):
            continue
        for s in ("int8", "int4", "latent4", "vector"):
            e = r.get(s)
            if e is None or "error" in e:
                continue
            verdicts = [f"{100 * e['copy_fraction']:.0f}% of copy "
                        + ("met" if e["copy_fraction"] >= GOAL_COPY else "MISSED")
                        + f" (goal {100 * GOAL_COPY:.0f}%)"]
            if s in GOAL_RATIO and "over_sdpa" in e:
                verdicts.append(f"×{e['over_sdpa']:.2f} SDPA "
                                + ("met" if e["over_sdpa"] <= GOAL_RATIO[s] else "MISSED")
                                + f" (goal ≤ ×{GOAL_RATIO[s]})")
            lines.append(f"- B={r['batch']} N={r['context']} {s}: " + "; ".join(verdicts))
    return lines


def markdown(report: dict) -> str:
    m = report["machine"]
    heads, kv_heads, head_dim = report["layer"]
    lines = [
        "# Decode attention over each cache scheme vs SDPA over the uncompressed cache",
        "",
        f"One layer: {heads} query heads, {kv_heads} KV heads, head dim {head_dim}; one query "
        f"token. Machine: {m['device']}; torch {m['torch']}"
        + (f", triton {m['triton']}" if "triton" in m else f", {m['threads']} thread(s)") + ".",
        f"dtype {report['dtype']}; SDPA backend {report['sdpa_backend']}; copy bandwidth "
        f"{report['copy_gb_per_s']:.1f} GB/s (large copy, bytes read + written); timing: "
        f"{report['timing']}; compiled: {report['compiler']}."
        + ("" if report["complete"] else " **Cut short: rows missing.**"),
        "",
        *(f"- `{s}`: {NOTES[s]}" for s in report["schemes"]),
        "",
        "bits = cache bits read per K/V value; GB/s = cache bytes read / time; %copy = that / "
        "copy bandwidth; ×SDPA = time / SDPA's; err = relative error of the compiled function "
        "against itself run eagerly.",
        "",
        "| B | N | scheme | bits | ms | GB/s | %copy | ×SDPA | err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        for s in report["schemes"]:
            e = r.get(s)
            if e is None:
                continue
            if "error" in e:
                lines.append(f"| {r['batch']} | {r['context']} | {s} | error: {e['error']} |")
                continue
            ratio, err = e.get("over_sdpa"), e.get("rel_err_vs_eager")
            lines.append(
                f"| {r['batch']} | {r['context']} | {s} | {e['bits_per_value']:.2f} "
                f"| {e['ms']:.3f} | {e['gb_per_s']:.0f} | {100 * e['copy_fraction']:.0f}% "
                f"| {'–' if ratio is None else f'{ratio:.2f}'} "
                f"| {'–' if err is None else f'{err:.1e}'} |")
    goals = goal_lines(report)
    if goals:
        batch, context = report["goal_shape"]
        lines += ["", f"Goals (issue #39, batch ≥ {batch} at ≥ {context} tokens):", "", *goals]
    return "\n".join(lines) + "\n"


def write(report: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_name(stem.name + ".md").write_text(markdown(report))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--out", type=Path, help="results stem (STEM.json, STEM.md)")
    parser.add_argument("--smoke", action="store_true",
                        help="toy layer and contexts, compiled schemes run as traced")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.smoke
    if gpu:
        from torch._inductor.compile_fx import compile_fx

        device, dtype, timer = torch.device("cuda"), torch.bfloat16, gpu_timer
        compile_fn = compile_fx
        layer_name, batches, contexts = "llama3-8b", [1, 8, 16], [4096, 8192, 16384, 32768]
        copy_gbs = copy_bandwidth(device, 1 << 30, timer)
        timing, compiler = "triton.testing.do_bench median", "make_fx + Inductor"
    else:
        torch.set_num_threads(1)
        device, dtype = torch.device("cpu"), torch.float32
        if args.smoke:
            layer_name, batches, contexts = "toy", [1, 2], [128]
            timer = lambda fn: cpu_timer(fn, 0.02)  # noqa: E731
            compile_fn, compiler = (lambda gm, inputs: gm), "make_fx only (smoke)"
            copy_gbs = copy_bandwidth(device, 1 << 24, timer)
        else:
            from torch._inductor.compile_fx import compile_fx

            layer_name, batches, contexts = "llama3-8b", [1], [1024, 4096]
            timer, compile_fn, compiler = cpu_timer, compile_fx, "make_fx + Inductor"
            copy_gbs = copy_bandwidth(device, 1 << 28, timer)
        timing = "minimum over repeated calls (shared machine)"
    batches, contexts = args.batches or batches, args.contexts or contexts
    shape = LAYERS[layer_name]
    backend, sdpa_context = sdpa_backend(device, shape, dtype)

    report = dict(machine=machine(device), layer=list(shape),
                  dtype=str(dtype).removeprefix("torch."),
                  schemes=args.schemes, sdpa_backend=backend, copy_gb_per_s=copy_gbs,
                  timing=timing, compiler=compiler, goal_shape=(2, 128) if args.smoke
                  else GOAL_SHAPE, complete=False, rows=[])
    slug = re.sub(r"[^a-z0-9]+", "-", (report["machine"]["device"] if gpu else "cpu").lower())
    stem = args.out or RESULTS / f"decode_attention-{slug.strip('-')}"
    print(f"{report['machine']['device']}: copy bandwidth {copy_gbs:.1f} GB/s", flush=True)
    shapes = sorted(((b, c) for b in batches for c in contexts),
                    key=lambda bc: priority(bc, report["goal_shape"]))
    for batch, context in shapes:
        layer = Layer(shape, batch, context, args.schemes, device, dtype, compile_fn)
        measured = measure(layer, args.schemes, timer, copy_gbs,
                           2 * batch * context * shape[1] * shape[2], sdpa_context)
        report["rows"].append(dict(batch=batch, context=context, **measured))
        write(report, stem)
        print(f"B={batch:<3} N={context:<6} " + "  ".join(
            f"{s} {e['ms']:.3f} ms ({100 * e['copy_fraction']:.0f}%)" if "ms" in e else
            f"{s} {e['error']}" for s, e in measured.items()), flush=True)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["complete"] = True
    write(report, stem)
    print(f"wrote {stem}.json and .md")
    return report


if __name__ == "__main__":
    main()
