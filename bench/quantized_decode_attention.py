"""One decode step of attention over a quantized cache, compiled, against SDPA over the full
float32 cache: the default model's layer shape (9 query heads, 3 KV heads, head dim 64).

    OMP_NUM_THREADS=1 python bench/quantized_decode_attention.py [--context 4096] [--bits 8 4]

Per code width it times (``torch.compile``, Inductor, batch 1, medians over ``--runs`` calls):

- ``sdpa``: ``scaled_dot_product_attention`` (``enable_gqa``) over float32 keys and values
  ``(1, 3, n, 64)``: what an uncompressed cache costs;
- ``plain fused`` / ``plain materialised``: a plain quantized plan (keys per channel over
  groups of 32 tokens, values per token, width 192 a token and side) read by
  ``quantized_kv_attention`` (codes read in the reductions: on an x86-64 CPU by the C++
  kernel ``lorc::code_attention``) / dequantized first (``lorc::dequantize``'s maths, then
  SDPA);
- ``latent fused`` / ``latent materialised``: post-RoPE latents of rank 96 a side (half the
  width), per channel over groups of 32, read by ``quantized_latent_attention`` /
  dequantized first, then ``latent_attention``;
- ``rotary fused`` / ``rotary materialised``: the same with keys cached before RoPE
  (``quantized_rotary_latent_attention`` / ``rotary_latent_attention``);
- ``manual full`` / ``manual codes`` / ``manual materialised``: eager attention as Gemma 2
  runs it (each KV head repeated per query head as ``repeat_kv`` does, ``q @ kᵀ``, a ``tanh``
  softcap, softmax, ``p @ v``) over the float32 cache / the plain plan's codes read by its two
  products (``quantized_scores``, ``quantized_sums``: what ``lorc_backend`` emits) / the
  codes dequantized first.

Every quantized side holds ``context`` quantized tokens with the layer's two spare groups of
slots, then a window of 5 tokens with two spare rows, as ``QuantizedLatentDynamicLayer`` hands
them over (so attention reads ``context + 5`` tokens; SDPA as many).
Prints a table and the ratios to ``sdpa``; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lorc_fx.cache.latent_ops import dequantize_codes_math  # noqa: E402
from lorc_fx.codes.integer import QuantSpec, quantize  # noqa: E402
from lorc_fx.compile.latent_attention import latent_attention, rotary_latent_attention  # noqa: E402
from lorc_fx.compile.quantized_attention import (quantized_kv_attention,  # noqa: E402
                                                 quantized_latent_attention,
                                                 quantized_rotary_latent_attention,
                                                 quantized_scores, quantized_sums)

HEADS, KV_HEADS, HEAD_DIM, GROUP, WINDOW, SPARE_GROUPS, SPARE_ROWS = 9, 3, 64, 32, 5, 2, 2


def inductor(fn, *inputs):
    """``fn`` traced to aten ops and compiled by Inductor, as ``lorc_backend`` compiles the
    rewritten graph (the functions are not meant for dynamo itself: ``torch._safe_softmax``);
    a function of no arguments."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    compiled = compile_fx(make_fx(fn)(*inputs), list(inputs))
    return lambda: compiled(*inputs)


def median_ms(fn, runs: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def side(x: torch.Tensor, spec: QuantSpec):
    """``x (b, h, n, w)``: its first ``n - WINDOW`` tokens as codes with spare group slots
    after them, then the window with spare rows after it, as the layer's ``(codes, window,
    tokens)``."""
    quantized = x.shape[2] - WINDOW
    spare = x.new_zeros(*x.shape[:2], SPARE_GROUPS * GROUP, x.shape[3])
    q = quantize(torch.cat([x[:, :, :quantized], spare], dim=2), spec)
    axis = -2 if spec.axis % 4 == 2 else -1
    # contiguous, as the layer's stores are (quantize itself may leave 8-bit codes token-major)
    codes = (q.payload.contiguous(), q.scale.contiguous(), q.zero.contiguous(), spec.bits,
             spec.group, axis, quantized, x.shape[3], x.dtype)
    window = torch.cat([x[:, :, quantized:], spare[:, :, :SPARE_ROWS]], dim=2)
    return codes, window, x.shape[2]


def dequantized(s):
    codes, window, tokens = s
    return torch.cat([dequantize_codes_math(*codes), window], dim=2)[:, :, :tokens]


SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def repeated(x):
    """``repeat_kv``: each KV head's copies side by side, ``(b, HEADS, n, d)``."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, HEADS // h, n, d).reshape(b, HEADS, n, d)


def softcapped(scores):
    return torch.softmax(torch.tanh(scores * HEAD_DIM ** -0.5 / SOFTCAP) * SOFTCAP, dim=-1)


def manual(q, k, v):
    """Gemma 2's eager attention over float keys and values ``(b, KV_HEADS, n, d)``."""
    return softcapped(q @ repeated(k).transpose(2, 3)) @ repeated(v)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--rank", type=int, default=96)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    n, width, r = args.context + WINDOW, KV_HEADS * HEAD_DIM, args.rank
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    k, v = torch.randn(1, KV_HEADS, n, HEAD_DIM), torch.randn(1, KV_HEADS, n, HEAD_DIM)
    k_latent, v_latent = torch.randn(1, 1, n, r), torch.randn(1, 1, n, r)
    k_basis = torch.linalg.qr(torch.randn(width, r)).Q.T.contiguous()
    v_basis = torch.linalg.qr(torch.randn(width, r)).Q.T.contiguous()
    cos, sin = torch.randn(1, n, HEAD_DIM), torch.randn(1, n, HEAD_DIM)
    sdpa = inductor(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                    q, k, v)
    base = median_ms(sdpa, args.runs)
    manual_full = median_ms(inductor(manual, q, k, v), args.runs)
    print(f"context {n}, batch 1, {torch.get_num_threads()} thread(s); sdpa over float32 "
          f"K/V: {base:.3f} ms")
    print(f"{'':>4} {'manual full':<22} {manual_full:8.3f} {manual_full / base:7.2f}")
    print(f"{'bits':>4} {'case':<22} {'ms':>8} {'/ sdpa':>7}")
    for bits in args.bits:
        ks = side(k, QuantSpec.per_channel(bits, GROUP))
        vs = side(v, QuantSpec.per_token(bits, GROUP))
        kl = side(k_latent, QuantSpec.per_channel(bits, GROUP))
        vl = side(v_latent, QuantSpec.per_channel(bits, GROUP))
        flat = lambda s: (*s[0][:3], s[1])  # noqa: E731  (the tensors of a side)
        side_of = lambda s, t: ((*t[:3], *s[0][3:]), t[3], s[2])  # noqa: E731
        cases = {
            "plain fused": (lambda q, *t: quantized_kv_attention(
                q, side_of(ks, t[:4]), side_of(vs, t[4:])), ks, vs),
            "plain materialised": (lambda q, *t: F.scaled_dot_product_attention(
                q, dequantized(side_of(ks, t[:4])), dequantized(side_of(vs, t[4:])),
                enable_gqa=True), ks, vs),
            "latent fused": (lambda q, *t: quantized_latent_attention(
                q, side_of(kl, t[:4]), side_of(vl, t[4:]), k_basis, v_basis, KV_HEADS), kl, vl),
            "latent materialised": (lambda q, *t: latent_attention(
                q, dequantized(side_of(kl, t[:4])), dequantized(side_of(vl, t[4:])), k_basis,
                v_basis, KV_HEADS, use_kernel=False), kl, vl),
            "rotary fused": (lambda q, *t: quantized_rotary_latent_attention(
                q, side_of(kl, t[:4]), cos, sin, side_of(vl, t[4:]), k_basis, v_basis,
                KV_HEADS, "half"), kl, vl),
            "rotary materialised": (lambda q, *t: rotary_latent_attention(
                q, dequantized(side_of(kl, t[:4])), cos, sin, dequantized(side_of(vl, t[4:])),
                k_basis, v_basis, KV_HEADS, "half"), kl, vl),
            "manual codes": (lambda q, *t: quantized_sums(softcapped(quantized_scores(
                q, side_of(ks, t[:4]))), side_of(vs, t[4:])), ks, vs),
            "manual materialised": (lambda q, *t: manual(
                q, dequantized(side_of(ks, t[:4])), dequantized(side_of(vs, t[4:]))), ks, vs),
        }
        for name, (fn, k_side, v_side) in cases.items():
            ms = median_ms(inductor(fn, q, *flat(k_side), *flat(v_side)), args.runs)
            print(f"{bits:>4} {name:<22} {ms:8.3f} {ms / base:7.2f}")


if __name__ == "__main__":
    main()
