"""The C++ kernel of ``lorc::code_scores`` / ``code_sums`` / ``code_attention`` against float64
maths over the dequantized codes (``lorc_fx.codes.integer``'s own ``dequantize``)."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.codes.integer import QuantSpec, quantize
from lorc_fx.kernels import code_reductions

X86_AVX2 = (platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").exists()
            and " avx2" in Path("/proc/cpuinfo").read_text())
native = pytest.mark.skipif(not X86_AVX2, reason="the kernel is built for x86-64 with AVX2")
SETTINGS = settings(max_examples=25, deadline=None)

widths = st.sampled_from([8, 4])
groups = st.sampled_from([32, 64, 96, 128])
scale_dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])  # read as stored


@native
def test_the_kernel_builds_here():
    """On an x86-64 machine with AVX2 (CI's) the kernel builds and the ops use it, so the
    tests below check it, not the fallback."""
    assert code_reductions._registered()
    assert code_reductions.native_applies(torch.device("cpu"), 8, 64)
    assert not code_reductions.native_applies(torch.device("cpu"), 2, 64)
    assert not code_reductions.native_applies(torch.device("cpu"), 8, 48)


def assert_float32_close(got, weights, values):
    """``got`` within float32 rounding of ``weights @ values`` (float64): the kernel adds
    ``count`` terms in float32 with the scale and zero point factored out, each term at most
    ``|weight|·(|value| + max|value|)`` (a zero point is within the group's range), each
    rounded a few times (weight times scale, the product, the zero point's part), and a
    sequential float32 sum of ``count`` terms is off by at most ``count·2⁻²⁴`` of their total."""
    roundings = weights.shape[-1] + 4
    bound = roundings * 2.0 ** -24 * (weights.abs() @ (values.abs() + values.abs().amax()))
    error = (got.double() - weights @ values).abs()
    assert (error <= bound).all(), (error.max(), bound.min())


def codes(x, spec):
    q = quantize(x, spec)
    return q.payload, q.scale, q.zero, q.dequantize().double()


@native
@SETTINGS
@given(bits=widths, group=groups, batch=st.integers(1, 2), kv_heads=st.integers(1, 3),
       rows=st.integers(1, 10), width=st.integers(1, 70), n_groups=st.integers(1, 4),
       scale_dtype=scale_dtypes, seed=st.integers(0, 99))
def test_scores_over_per_channel_codes(bits, group, batch, kv_heads, rows, width, n_groups,
                                       scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, kv_heads, n_groups * group, width, generator=gen) * 3
    payload, scale, zero, values = codes(x, QuantSpec.per_channel(bits, group, scale_dtype))
    q = torch.randn(batch, kv_heads, rows, width, generator=gen)
    got = torch.ops.lorc.code_scores(q, payload, scale, zero, bits)
    assert_float32_close(got, q.double(), values.transpose(-1, -2))


@native
@SETTINGS
@given(bits=widths, group=st.sampled_from([32, 64]), channel_groups=st.integers(1, 3),
       batch=st.integers(1, 2), kv_heads=st.integers(1, 3), rows=st.integers(1, 10),
       tokens=st.integers(1, 300), scale_dtype=scale_dtypes, seed=st.integers(0, 99))
def test_sums_over_per_token_codes(bits, group, channel_groups, batch, kv_heads, rows, tokens,
                                   scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, kv_heads, tokens, group * channel_groups, generator=gen)
    payload, scale, zero, values = codes(x, QuantSpec.per_token(bits, group, scale_dtype))
    p = torch.rand(batch, kv_heads, rows, tokens, generator=gen)
    got = torch.ops.lorc.code_sums(p, payload, scale, zero, bits)
    assert_float32_close(got, p.double(), values)


@native
@SETTINGS
@given(bits=widths, group=st.sampled_from([32, 64]), batch=st.integers(1, 2),
       kv_heads=st.integers(1, 3), per_head=st.integers(1, 4), t=st.integers(1, 3),
       n_groups=st.integers(1, 3), window=st.integers(0, 9), short=st.integers(0, 40),
       mask=st.sampled_from(["none", "bool", "float"]), k_scales=scale_dtypes,
       v_scales=scale_dtypes, seed=st.integers(0, 99))
def test_fused_attention_is_the_softmax_of_the_scores_over_the_values(
        bits, group, batch, kv_heads, per_head, t, n_groups, window, short, mask, k_scales,
        v_scales, seed):
    """Keys per channel and values per token (64 channels a head), then window rows; without
    a window the values may stop ``short`` of the keys' slots, the bias masking the rest (a
    static layer's spare key group). Query row ``i`` of a kv head is query token ``i % t``; a
    row with nothing to attend gets zeros. The two sides' scales may differ in dtype."""
    gen = torch.Generator().manual_seed(seed)
    d, n = 64, n_groups * group
    n_v = n if window else max(n - short, 1)
    k_payload, k_scale, k_zero, keys = codes(torch.randn(batch, kv_heads, n, d, generator=gen) * 2,
                                             QuantSpec.per_channel(bits, group, k_scales))
    v_payload, v_scale, v_zero, values = codes(torch.randn(batch, kv_heads, n_v, d, generator=gen),
                                               QuantSpec.per_token(bits, group, v_scales))
    k_window, v_window = (torch.randn(batch, kv_heads, window, d, generator=gen) for _ in "kv")
    if mask == "float":
        bias = torch.randn(batch, t, n + window, generator=gen)
    else:
        attends = torch.rand(batch, t, n + window, generator=gen) < (0.7 if mask == "bool" else 2)
        attends[0, 0] = mask == "none"  # a row with nothing to attend, when masked
        bias = torch.where(attends, 0.0, float("-inf"))
    bias[..., n_v:n] = float("-inf")
    q = torch.randn(batch, kv_heads, per_head * t, d, generator=gen)
    got = torch.ops.lorc.code_attention(q, k_payload, k_scale, k_zero, bits, v_payload, v_scale,
                                        v_zero, bits, k_window, v_window, bias, 0.2)
    all_keys = torch.cat([keys, k_window.double()], dim=2)
    unread = values.new_zeros(batch, kv_heads, n - n_v, d)  # weighed by zero
    all_values = torch.cat([values, unread, v_window.double()], dim=2)
    scores = q.double() @ all_keys.transpose(-1, -2) * 0.2 + bias.double().repeat(1, per_head, 1)[:, None]
    assert_float32_close(got, torch._safe_softmax(scores, -1), all_values)


@native
def test_the_ops_refuse_codes_the_kernel_does_not_read():
    """The passes ask ``native_applies`` before they call an op; called directly with codes it
    does not read, an op says which and why rather than reading them wrongly."""
    assert code_reductions.native_applies(torch.device("cpu"), 8, 32)
    q = torch.randn(1, 1, 3, 8)
    payload, scale, zero, _ = codes(torch.randn(1, 1, 32, 8), QuantSpec.per_channel(2, 32))
    with pytest.raises(RuntimeError, match="lorc::code_scores: codes of 8 or 4 bits, not 2"):
        torch.ops.lorc.code_scores(q, payload, scale, zero, 2)
    payload, scale, zero, _ = codes(torch.randn(1, 1, 48, 8), QuantSpec.per_channel(8, 48))
    with pytest.raises(RuntimeError, match="groups of a multiple of 32 codes, not 48"):
        torch.ops.lorc.code_scores(q, payload, scale, zero, 8)