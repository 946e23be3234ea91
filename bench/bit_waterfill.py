"""Bits per latent channel by reverse water-filling (issue #13):
an exploration (its keys-only 4.5-bit allocation is now the planner's ``keys_waterfilled``
plan, ``lorc_fx.plan.bit_allocation``). Results: bench/results/bit_waterfill-cpu.md.

    OMP_NUM_THREADS=1 python bench/bit_waterfill.py --bits 2.56,1.92 \
        --widths 4 --widths 2.4.8 --key-shares 0.3,0.4,0.5 [--sets self_held,news,austen,poems]
    OMP_NUM_THREADS=1 python bench/bit_waterfill.py --bits 4.5 --values kivi --group 256 \
        --widths 3.4.8 --key-shares 0 [--key-basis identity]
    OMP_NUM_THREADS=2 python bench/bit_waterfill.py --coder codebook --sink 1 \
        --preserve-variance --bits 2.56,1.92 --key-shares 0.35,0.4,0.45
    OMP_NUM_THREADS=2 python bench/bit_waterfill.py --coder vector --tuple-dims 16 \
        --half-widths --sink 1 --preserve-variance --bits 2.56,1.92 \
        --key-shares 0.35,0.4,0.45 --choose-share --sets self_held,news,austen,poems [--books FILE]

Today a plan stores each side's latent at one bit width and cuts its rank to fill the budget:
channels are either kept at that width or dropped. The latent channels are the rows of a
data-aware basis, most energy first, so this is transform coding, whose classical answer
(reverse water-filling) is to give each channel bits according to its energy: ``b_c ≈
b̄ + ½·log2(e_c / ē)``; dropping a channel is the 0-bit case. This script measures what
per-channel widths would buy at a fixed byte budget, with the planner's own bases.

Method. The default basis (``attention``, calibrated on self-sampled text, keys before RoPE:
``rope='reconstruct'``) at full rank, every layer and side. A fake-quantizing cache (like
bench/int4_variants.py: residual 0, every token quantized) takes each layer's keys back
before RoPE, projects keys and values to the latents, quantizes channel ``c`` per channel
over groups of ``G`` tokens at ``b_c`` bits (0: dropped), rebuilds and rotates back.

Allocation. A channel's error at width ``b`` is modelled as ``e_c · ρ_c(b)``: ``e_c`` its
spectrum energy (the error of dropping it, in the planner's one unit), ``ρ_c(b)`` its relative
squared quantization error measured on the calibration sample (``ρ(0) = 1``). Its cost is
``b + 32/G`` bits per token (codes, 16-bit scale and zero) for ``b > 0``. Greedy on each
channel's lower convex hull of (cost, error) spends the budget where the error falls fastest.
Keys and values get separate budgets (``--key-shares``: the keys' share of the latent bits):
the planner's key energies misjudge how layers compare with values (plan/allocation.py).
``--widths 4`` is the plan's own trade (4-bit latents, rank cut per layer): the control.
``--values kivi`` keeps values as KIVI's 4-bit per-token codes (4.5 bits, no basis) and
water-fills the keys alone with the rest of the budget (``--key-shares`` unused).

Coders (``--coder``; how a kept channel's values are stored at its width):

- ``uniform`` (the cache's codes): per channel over groups of ``--group`` tokens, 16-bit
  scale and zero point, ``ρ_c(b)`` measured;
- ``codebook``: each channel at ``b`` bits as the nearest of its own ``2^b`` levels, fitted by
  Lloyd's algorithm (one-dimensional k-means from the quantiles, 30 iterations) on the
  calibration sample, widths 1-6, no scales: the tables are per model, like weights, not per
  token (``--preserve-variance`` scales a channel's reconstructions about its mean back to
  its variance, which centroids shrink); the ``vector`` coder below in tuples of one channel;
- ``vector``: product vector codes (``lorc_fx.cache.vector_codes``): channels allocated in
  tuples of ``--tuple-dims`` consecutive channels (8 or 16), one width a tuple; a tuple at
  ``b`` bits a channel is cut into sub-vectors of ``d`` channels (``sub_dims``: 16 at 0.5
  bits in tuples of 16, 8 in tuples of 8; 8 at 1 bit, 4 at 1.5 and 2, 2 at 2.5 and 3, 1 from
  4 bits on), each coded as the index of its nearest of ``2^(d·b)`` codewords fitted by
  k-means on the calibration sample, no scales (``--half-widths`` adds 0.5, 1.5 and 2.5
  bits; ``--preserve-variance`` as for codebooks; ``--rho-on self_held``: the allocation's
  errors measured out of the fit's sample);
- ``gaussian-bound``: no coder, the reference of what one at Shannon's rate-distortion bound
  for a Gaussian source of the channel's variance would leave: independent noise of variance
  ``σ_c²·2^(-2b)``, integer widths 1-12, no scales.

``--sink N`` keeps the first N tokens of every window at 16 bits (the attention sink), their
cost counted as 16 bits per value over 512-token windows and taken from the budget.

Bits per value count everything: codes, 16-bit scales and zeros, and the RoPE angle log
(64 16-bit values per token shared by all layers, +0.089), over 2·192·30 values per token.
The key share and the widths are chosen on ``self_held`` (the planner's held-out windows);
news, Austen and poems are evaluated only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.api import _plan_inputs, checked_options  # noqa: E402
from lorc_fx.cache.latent_ops import project_math, reconstruct_math  # noqa: E402
from lorc_fx.cache.quantize import QuantSpec, fake_quantize  # noqa: E402
from lorc_fx.cache.rotary import rotate  # noqa: E402
from lorc_fx.cache.vector_codes import (VECTOR_WIDTHS, VectorSpec, decode, encode, fit,  # noqa: E402
                                        select, sub_dims)
from lorc_fx.eval.evaluate import evaluation_windows  # noqa: E402
from lorc_fx.plan.bit_allocation import allocate as water_fill  # noqa: E402
from lorc_fx.plan.planner import _key_spectrum, _value_spectrum  # noqa: E402
from lorc_fx.plan.spectra import Spectrum  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from int4_variants import install_hooks, Ctx, self_sets  # noqa: E402

OUT = Path(__file__).parent / "results" / "bit_waterfill-cpu.jsonl"
FULL = Path(__file__).parent / "results" / "int4_variants_full-cpu.json"
SCALE = torch.float16
ANGLE_BITS = 64 * 16  # the RoPE angle log, bits per token
WIDTHS = (2, 3, 4, 8)
KIVI_VALUES = QuantSpec.per_token(4, 64, SCALE)  # --values kivi: 4.5 bits per value
CODEBOOK_WIDTHS = tuple(range(1, 7))  # --coder codebook: up to 64 levels a channel
BOUND_WIDTHS = tuple(range(1, 13))  # --coder gaussian-bound
HALF_WIDTHS = tuple(b for b in VECTOR_WIDTHS if b % 1)  # --coder vector --half-widths
SINK_BITS = 16 / 512  # a 16-bit sink token's bits per value, counted at 512-token windows


class Codec:
    """One layer's full-rank bases, ``(192, 192)`` rows, most energy first."""

    def __init__(self, k, v, heads, style):
        self.kp, self.kb = k.rows.float(), (k.rows if k.rebuild_rows is None else k.rebuild_rows).float()
        self.vp, self.vb = v.rows.float(), (v.rows if v.rebuild_rows is None else v.rebuild_rows).float()
        self.heads, self.style = heads, style


def _by_width(z, bits, code):
    """``z (b, 1, s, r)`` with the channels of each width ``b > 0`` replaced by
    ``code(their columns, b, their indices)``; 0 bits: dropped."""
    out = torch.zeros_like(z)
    for b in sorted(set(bits) - {0}):
        idx = torch.tensor([c for c, w in enumerate(bits) if w == b])
        out[..., idx] = code(z[..., idx], b, idx)
    return out


class UniformCoder:
    """Today's codes: per channel over groups of ``group`` tokens, 16-bit scale and zero."""

    def __init__(self, group):
        self.group, self.overhead_group = group, group

    def __call__(self, z, bits):
        return _by_width(z, bits, lambda part, b, idx: part if b >= 16 else fake_quantize(
            part, QuantSpec.per_channel(b, self.group, SCALE))[0])


class VectorCoder:
    """``--coder vector`` (``lorc_fx.cache.vector_codes``): the channels in tuples of
    ``tuple_dims`` consecutive channels (energy order), one width a tuple; a tuple at ``b``
    bits a channel is coded as sub-vectors of ``sub_dims(b)`` channels, each the nearest of
    its own codewords fitted on calibration text (k-means), no scales. ``books[b]``: every
    channel at width ``b``; an allocation's book is cut from them (``select``)."""

    overhead_group = math.inf

    def __init__(self, books, tuple_dims):
        self.books, self.tuple_dims = books, tuple_dims

    def __call__(self, z, bits):
        out = torch.zeros_like(z[:, 0], dtype=torch.float32)  # (b, s, r)
        if any(bits):
            book, kept = select(self.books, bits, self.tuple_dims)
            out[..., kept] = decode(encode(z[:, 0, :, kept].float(), book), book)
        return out[:, None].to(z.dtype)


def fit_vectors(stats, tuple_dims, keep_variance, widths, iters):
    """Per side, a ``VectorCoder`` over ``widths`` fitted on the calibration samples."""
    coders = {}
    for key, s in tqdm(stats.items(), desc="vector codebooks"):
        x = torch.cat(s["samples"])
        coders[key] = VectorCoder({b: fit(x, VectorSpec(((x.shape[1], b),), tuple_dims),
                                          keep_variance, iters) for b in widths}, tuple_dims)
    return coders


def vector_coders(stats, widths, tuple_dims, keep_variance, books, iters):
    """Per side, a ``VectorCoder`` over ``widths``: read from the file ``books`` where it has
    them cut as ``tuple_dims`` cuts them, the rest fitted (and the file rewritten)."""
    coders = {}
    if books and Path(books).exists():
        coders = torch.load(books, weights_only=False)
        print(f"vector codebooks read from {books}", flush=True)
    missing = [b for b in widths if not coders or any(
        b not in c.books or c.books[b].spec.layout()[0][2] != sub_dims(b, tuple_dims)
        for c in coders.values())]
    if missing:
        fitted = fit_vectors(stats, tuple_dims, keep_variance, missing, iters)
        coders = {key: VectorCoder({**(coders[key].books if coders else {}),
                                    **fitted[key].books}, tuple_dims) for key in fitted}
        if books:
            torch.save(coders, books)
            print(f"vector codebooks written to {books}", flush=True)
    return {key: VectorCoder(c.books, tuple_dims) for key, c in coders.items()}


def vector_errors(stats, coders):
    """Per side, the relative errors per width and channel of its ``VectorCoder`` on the
    samples of ``stats`` (the calibration sample it was fitted on, or ``--rho-on``'s)."""
    rho = {}
    for key, s in stats.items():
        x = torch.cat(s["samples"])
        rho[key] = {b: (((decode(encode(x[None], book), book)[0] - x).double() ** 2).sum(0)
                        / s["power"].clamp_min(1e-30)).tolist()
                    for b, book in coders[key].books.items()}
    return rho


class GaussianBound:
    """``--coder gaussian-bound``: not a coder but what one at Shannon's rate-distortion bound
    for a Gaussian source leaves at ``b`` bits per token: independent noise of variance
    ``σ_c² · 2^(-2b)`` (``σ_c`` the channel's calibration standard deviation), no scales."""

    overhead_group = math.inf

    def __init__(self, std, generator):
        self.std, self.generator = std, generator

    def __call__(self, z, bits):
        def code(part, b, idx):
            noise = torch.randn(part.shape, generator=self.generator, dtype=part.dtype)
            return part + noise * (self.std[idx].to(part.dtype) * 2.0 ** -b)
        return _by_width(z, bits, code)


class WaterLayer(DynamicLayer):
    """Scores one forward: the incoming keys/values through the latents at ``bits`` coded by
    ``coders`` (keys', values'), the first ``sink`` tokens' latents left as they came (16
    bits); or, collecting, adds the coded tokens' moments per channel, squared rounding errors
    per width (``UniformCoder(group)``) and samples to ``stats``."""

    def __init__(self, idx, codec: Codec, bits=None, coders=None, sink=0, group=64, stats=None):
        super().__init__()
        self.idx, self.codec, self.bits, self.coders = idx, codec, bits, coders
        self.sink, self.group, self.stats = sink, group, stats

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.codec
        cos, sin = Ctx.cos[self.idx].to(key_states.dtype), Ctx.sin[self.idx].to(key_states.dtype)
        zk = project_math(rotate(key_states, cos, sin, c.style, inverse=True), c.kp)
        zv = project_math(value_states, c.vp)
        n = self.sink  # the window's first tokens: never coded, their latents kept as they came
        if self.stats is not None:
            for side, z in (("k", zk[:, :, n:]), ("v", zv[:, :, n:])):
                s = self.stats.setdefault((self.idx, side), {"power": 0.0, "sum": 0.0, "count": 0,
                                                             "samples": []})
                s["power"] = s["power"] + (z.double() ** 2).sum((0, 1, 2))
                s["sum"] = s["sum"] + z.double().sum((0, 1, 2))
                s["count"] += z[..., 0].numel()
                s["samples"].append(z.reshape(-1, z.shape[-1]).float())
                for b in WIDTHS:
                    err = fake_quantize(z, QuantSpec.per_channel(b, self.group, SCALE))[0] - z
                    s[b] = s.get(b, 0.0) + (err.double() ** 2).sum((0, 1, 2))
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        (kb, vb), (kc, vc) = self.bits, self.coders

        def coded(z, bits, coder):
            return torch.cat([z[:, :, :n], coder(z[:, :, n:], bits)], 2)

        keys = rotate(reconstruct_math(coded(zk, kb, kc), c.kb, c.heads), cos, sin, c.style)
        if vb is None:  # KIVI's values: per token, groups of 64 channels, no basis
            values = torch.cat([value_states[:, :, :n],
                                fake_quantize(value_states[:, :, n:], KIVI_VALUES)[0]], 2)
        else:
            values = reconstruct_math(coded(zv, vb, vc), c.vb, c.heads)
        self.keys, self.values = keys, values
        return keys, values


class WaterCache(Cache):
    def __init__(self, codecs, bits=None, coders=None, sink=0, group=64, stats=None):
        super().__init__(layers=[
            WaterLayer(i, c, None if bits is None else bits[i], None if coders is None else coders[i],
                       sink, group, stats) for i, c in enumerate(codecs)])


def spectra(model, blocks):
    options, inputs, _ = _plan_inputs(model, blocks, checked_options(1.0, rope="reconstruct"))
    return ([_key_spectrum(l, options.rope) for l in inputs],
            [_value_spectrum(l) for l in inputs])


def identity_keys(spectrum: Spectrum) -> Spectrum:
    """The keys' own channels as the basis (``--key-basis identity``), each channel's energy
    the error of dropping it in the planner's metric: for rows ``P`` and rebuild rows ``B`` of
    energies ``e`` (``B Pᵀ = I``), channel ``c`` costs ``Σ_i P_ic·B_ic·e_i`` (the diagonal of
    the metric-weighted key moment; for an orthonormal basis, of ``Pᵀ diag(e) P``)."""
    rebuild = spectrum.rows if spectrum.rebuild_rows is None else spectrum.rebuild_rows
    energy = (spectrum.rows * rebuild * spectrum.energy[:, None]).sum(0)
    eye = torch.eye(spectrum.width, dtype=spectrum.rows.dtype)
    return Spectrum(eye, energy, torch.ones(spectrum.width + 1, dtype=torch.bool))


def allocate(energies, rho, budget, widths, group, unit=1):
    """The planner's water-filling (``plan.bit_allocation.allocate``) and the bits per token
    it spends (``group``: tokens per 16-bit scale and zero; ``math.inf``: none). ``unit``:
    channels allocated together (consecutive tuples of that many, one width each; a
    tuple's error is its channels')."""
    tuple_energy = [e.view(-1, unit).sum(1) for e in energies]
    tuple_rho = [{b: (e * torch.tensor(r[b], dtype=e.dtype)).view(-1, unit).sum(1)
                  / te.clamp_min(1e-30) for b in r} for e, r, te in zip(energies, rho, tuple_energy)]
    tuple_bits = water_fill(tuple_energy, tuple_rho, budget / unit, widths, group)
    bits = [[b for b in layer for _ in range(unit)] for layer in tuple_bits]
    return bits, sum(b + 32 / group for layer in bits for b in layer if b)


def uniform_errors(stats):
    """``UniformCoder``'s relative rounding errors per side, width and channel, as measured."""
    return {key: {b: (s[b] / s["power"].clamp_min(1e-30)).tolist() for b in WIDTHS}
            for key, s in stats.items()}


def gaussian_bounds(stats):
    """Per side, a ``GaussianBound`` and its relative errors ``(σ² / power) · 2^(-2b)``."""
    generator = torch.Generator().manual_seed(0)
    coders, rho = {}, {}
    for key, s in stats.items():
        variance = (s["power"] / s["count"] - (s["sum"] / s["count"]) ** 2).clamp_min(0)
        share = variance * s["count"] / s["power"].clamp_min(1e-30)
        coders[key] = GaussianBound(variance.sqrt().float(), generator)
        rho[key] = {b: (share * 2.0 ** (-2 * b)).tolist() for b in BOUND_WIDTHS}
    return coders, rho


def plan_bits(k_spectra, v_spectra, rho, target, key_share, widths, group, values_per_token,
              kivi_values=False, sink=0, unit=1):
    """Per layer (key bits, value bits) at ``target`` bits per value, a 16-bit ``sink``'s
    bits taken from it; with ``kivi_values`` the values are KIVI's 4-bit per-token codes
    (4.5 bits each, value bits ``None``) and the keys take the rest of the budget."""
    layers = range(len(k_spectra))
    budget = (target - sink * SINK_BITS) * values_per_token - ANGLE_BITS
    k_energy = [s.energy for s in k_spectra]
    if kivi_values:
        fixed = KIVI_VALUES.bits_per_value() * sum(v.width for v in v_spectra)
        kbits, kspent = allocate(k_energy, [rho[(l, "k")] for l in layers], budget - fixed,
                                 widths, group, unit)
        return ([(k, None) for k in kbits],
                (kspent + fixed + ANGLE_BITS) / values_per_token + sink * SINK_BITS)
    kbits, kspent = allocate(k_energy, [rho[(l, "k")] for l in layers], key_share * budget,
                             widths, group, unit)
    vbits, vspent = allocate([s.energy for s in v_spectra], [rho[(l, "v")] for l in layers],
                             budget - kspent, widths, group, unit)
    bits = (kspent + vspent + ANGLE_BITS) / values_per_token + sink * SINK_BITS
    return list(zip(kbits, vbits)), bits


@torch.no_grad()
def score(model, windows, codecs, bits=None, coders=None, sink=0, group=64, stats=None,
          batch_size=2):
    total, count, per = 0.0, 0, []
    for batch in windows.split(batch_size):
        kwargs = {"use_cache": False}
        if codecs is not None:
            kwargs = {"use_cache": True,
                      "past_key_values": WaterCache(codecs, bits, coders, sink, group, stats)}
        logits = model(batch, **kwargs).logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        per += ce.mean(1).tolist()
        total += float(ce.sum())
        count += ce.numel()
    return total / count, per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2.56,1.92")
    ap.add_argument("--widths", action="append", help="allowed widths, e.g. 4 or 2.4.8")
    ap.add_argument("--key-shares", default="0.3,0.4,0.5")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--sets", default="self_held")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--values", choices=("latent", "kivi"), default="latent",
                    help="kivi: values as KIVI's 4-bit per-token codes, keys take the rest")
    ap.add_argument("--key-basis", choices=("planner", "identity"), default="planner",
                    help="identity: water-fill the keys' own pre-RoPE channels (no basis)")
    ap.add_argument("--coder", choices=("uniform", "codebook", "vector", "gaussian-bound"),
                    default="uniform", help="how kept channels are stored (module docstring)")
    ap.add_argument("--tuple-dims", type=int, default=8,
                    help="vector: consecutive channels allocated one width together")
    ap.add_argument("--books", help="codebook, vector: a file of fitted codebooks to read, or "
                                     "to write once fitted (vector: ~19 min on 2 threads)")
    ap.add_argument("--rho-on", choices=("self_held",),
                    help="codebook, vector: the allocation's errors measured on this sample instead of "
                         "the calibration sample the codebooks were fitted on")
    ap.add_argument("--choose-share", action="store_true",
                    help="evaluate every key share on the first set, the others at its best")
    ap.add_argument("--half-widths", action="store_true",
                    help=f"vector: widths {HALF_WIDTHS} too (a tuple's index a whole number of bits)")
    ap.add_argument("--sink", type=int, default=0,
                    help="the first N tokens of each window at 16 bits; their bits, counted at "
                         "512-token windows, come out of the budget")
    ap.add_argument("--preserve-variance", action="store_true",
                    help="codebook: each channel's reconstructions scaled about its mean to "
                         "its calibration variance (centroids shrink it)")
    args = ap.parse_args()
    if args.coder != "uniform" and (args.widths or args.values == "kivi"):
        ap.error(f"--coder {args.coder} picks its own widths and codes both sides: "
                 "drop --widths and --values kivi")
    if args.half_widths and args.coder != "vector":
        ap.error("--half-widths goes with --coder vector")
    tuple_dims = 1 if args.coder == "codebook" else args.tuple_dims
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model = lorc_fx.load_model("default")
    tok = lorc_fx.load_tokenizer("default")
    install_hooks(model)
    blocks = lorc_fx.analyze(model)
    ks, vs = spectra(model, blocks)
    if args.key_basis == "identity":
        ks = [identity_keys(k) for k in ks]
    style = blocks[0].rope_k.style
    heads = model.config.num_key_value_heads
    codecs = [Codec(k, v, heads, style) for k, v in zip(ks, vs)]
    values_per_token = sum(k.width + v.width for k, v in zip(ks, vs))
    selfs = self_sets(model)
    stats = {}
    t = time.time()
    score(model, selfs["self_calib"], codecs, sink=args.sink, group=args.group, stats=stats)
    print(f"quantization errors measured on the calibration sample ({time.time() - t:.0f}s)", flush=True)
    if args.coder == "uniform":
        uniform = UniformCoder(args.group)
        side_coders, rho = {key: uniform for key in stats}, uniform_errors(stats)
        allowed = [tuple(int(b) for b in w.split(".")) for w in args.widths or ["4"]]
    elif args.coder == "gaussian-bound":
        allowed = [BOUND_WIDTHS]
        side_coders, rho = gaussian_bounds(stats)
    else:  # codebook: the vector coder in tuples of one channel
        allowed = [tuple(sorted(CODEBOOK_WIDTHS + (HALF_WIDTHS if args.half_widths else ())))]
        side_coders = vector_coders(stats, allowed[0], tuple_dims, args.preserve_variance,
                                    args.books, iters=30 if args.coder == "codebook" else 15)
        if args.rho_on:  # the errors the allocation weighs, out of the fit's sample
            stats = {}
            score(model, selfs[args.rho_on], codecs, sink=args.sink, stats=stats)
        rho = vector_errors(stats, side_coders)
    coders = [(side_coders[(l, "k")], side_coders[(l, "v")]) for l in range(len(codecs))]
    overhead_group = coders[0][0].overhead_group
    sets = {n: selfs[n] if n.startswith("self") else
            evaluation_windows(tok, lorc_fx.load_text(n), args.tokens, 512)
            for n in args.sets.split(",")}
    full = json.loads(FULL.read_text()) if FULL.exists() else {}
    base = {}
    for n, w in sets.items():
        key = f"{n}:{tuple(w.shape)}"
        if key not in full:
            loss, per = score(model, w, None)
            full[key] = {"loss": loss, "per": per}
        base[n] = full[key]
    first = next(iter(sets))
    loss16, _ = score(model, sets[first], codecs, [([16] * k.width, [16] * v.width)
                                                   for k, v in zip(ks, vs)],
                      [(UniformCoder(64),) * 2] * len(codecs))
    print(f"full-rank 16-bit latents on {first}: Δloss {loss16 - base[first]['loss']:+.5f}", flush=True)

    def measure(target, wtuple, share, names):
        """Δloss of the allocation at ``target`` bits, widths ``wtuple`` and keys' ``share``
        on each set of ``names``, written out."""
        widths = ".".join(map(str, wtuple))
        bits, measured = plan_bits(ks, vs, rho, target, share, wtuple, overhead_group,
                                   values_per_token, args.values == "kivi", args.sink,
                                   tuple_dims if args.coder in ("codebook", "vector") else 1)
        hist = {b: sum(x.count(b) for kv in bits for x in kv if x is not None)
                for b in (0, *wtuple)}
        out = {}
        for n in names:
            w = sets[n]
            t = time.time()
            loss, per = score(model, w, codecs, bits, coders, args.sink)
            d = [a - b for a, b in zip(per, base[n]["per"])]
            m = sum(d) / len(d)
            se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
            dloss = out[n] = loss - base[n]["loss"]
            rec = {"target": target, "widths": widths, "values": args.values,
                   "coder": args.coder, "sink": args.sink,
                   "tuple_dims": args.tuple_dims if args.coder == "vector" else None,
                   "rho_on": args.rho_on or "self_calib",
                   "preserve_variance": args.preserve_variance,
                   "key_basis": args.key_basis,
                   "key_share": None if args.values == "kivi" else share,
                   "group": args.group if args.coder == "uniform" else None,
                   "bits": measured, "set": n, "dloss": dloss, "ratio": math.exp(dloss),
                   "se": se, "channels_per_width": hist,
                   "key_channels": sum(sum(1 for x in k if x) for k, _ in bits),
                   "value_channels": sum(sum(1 for x in v if x) for _, v in bits
                                         if v is not None),
                   "seconds": time.time() - t}
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{target:.2f} b  widths {widths:8s} keys {share:.2f}  {n:10s} bits {measured:.3f} "
                  f"Δloss {dloss:+.4f}±{se:.4f} ×{math.exp(dloss):.4f}  {hist}", flush=True)
        return out

    for target in (float(b) for b in args.bits.split(",")):
        for wtuple in allowed:
            shares = [float(s) for s in args.key_shares.split(",")]
            if args.choose_share:
                on_first = {share: measure(target, wtuple, share, [first])[first] for share in shares}
                measure(target, wtuple, min(on_first, key=on_first.get),
                        [n for n in sets if n != first])
            else:
                for share in shares:
                    measure(target, wtuple, share, list(sets))


if __name__ == "__main__":
    main()
