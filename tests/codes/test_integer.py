"""Group quantization of cache tensors (lorc_fx.codes.integer): packing, round trip, bytes."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.codes.integer import (ChannelSplit, QuantSpec, SplitTensor, dequantize, map_batch,
                                    pack_bits, pack_int4, quantize, round_to, token_count,
                                    token_slots, unpack_bits, unpack_int4)

QUANT_BITS = (2, 3, 4, 8)


def _group_for(bits: int, draw_factor: int) -> int:
    """A group size that holds whole bytes of ``bits``-bit codes."""
    unit = 8 // math.gcd(8, bits)
    return unit * draw_factor


@st.composite
def specs(draw, bits=st.sampled_from(QUANT_BITS)):
    b = draw(bits)
    group = _group_for(b, draw(st.integers(1, 16)))
    axis = draw(st.sampled_from((-1, -2)))
    scale_dtype = draw(st.sampled_from((None, torch.float16, torch.bfloat16, torch.float32)))
    return QuantSpec(b, group, axis, scale_dtype)


@st.composite
def tensors(draw, dtype=torch.float32):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=2, max_size=4)))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    magnitude = draw(st.sampled_from((1e-3, 1.0, 30.0)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * magnitude
    # channels of very different ranges, outliers, exactly constant runs
    x = x * torch.logspace(-2, 1, shape[-1])
    if draw(st.booleans()):
        x[..., 0] = 0.0
    return x.to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from((2, 3, 4, 8)), st.lists(st.integers(1, 4), min_size=0, max_size=3),
       st.integers(1, 6), st.integers(0, 2 ** 31 - 1))
def test_pack_unpack_bit_exact(bits, lead, words, seed):
    n = words * 8  # any multiple of 8 codes is a whole number of bytes for every width
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=gen, dtype=torch.int64)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes.to(torch.uint8))
    # and the other way round: every byte pattern is some codes
    raw = torch.randint(0, 256, packed.shape, generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_bits(unpack_bits(raw, bits), bits), raw)


def test_int4_layout_first_half_in_low_nibbles():
    codes = torch.tensor([1, 2, 15, 0, 7, 9], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [0x01, 0x72, 0x9F]
    assert torch.equal(unpack_int4(packed), codes)


def test_int4_needs_even_length():
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


def _bound(q, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |x - dequantize(q)|: scale/2, plus float rounding of the
    dequantization and of the output dtype (relative to the dequantized value, which can be
    up to scale/2 larger than x)."""
    spec = q.spec
    scale = q.scale.float()[..., None].expand(*q.scale.shape, spec.group)
    scale = scale.reshape(*scale.shape[:-2], -1)[..., :x.shape[spec.axis]].movedim(-1, spec.axis)
    zero = q.zero.float()[..., None].expand(*q.zero.shape, spec.group)
    zero = zero.reshape(*zero.shape[:-2], -1)[..., :x.shape[spec.axis]].movedim(-1, spec.axis)
    eps = torch.finfo(x.dtype).eps
    magnitude = x.float().abs() + zero.abs() + scale * ((1 << spec.bits) - 1)
    return scale / 2 * (1 + 1e-5) + 4 * torch.finfo(torch.float32).eps * magnitude \
        + eps * (x.float().abs() + scale)


@settings(max_examples=80, deadline=None)
@given(specs(), tensors())
def test_round_trip_error_within_half_a_step(spec, x):
    q = quantize(x, spec)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (y.float() - x.float()).abs()
    assert bool((err <= _bound(q, x)).all()), float((err - _bound(q, x)).max())
    codes = unpack_bits(q.payload, spec.bits)
    assert int(codes.max()) < (1 << spec.bits)


@settings(max_examples=30, deadline=None)
@given(specs(st.sampled_from((4, 8))), tensors(torch.bfloat16))
def test_round_trip_bf16(spec, x):
    q = quantize(x, spec)
    err = (dequantize(q).float() - x.float()).abs()
    assert bool((err <= _bound(q, x)).all())


@settings(max_examples=40, deadline=None)
@given(specs(), tensors())
def test_bytes_accounting_equals_measured(spec, x):
    q = quantize(x, spec)
    assert q.nbytes == spec.nbytes(x.shape, x.dtype)
    if x.shape[spec.axis] % spec.group == 0:
        assert q.nbytes == pytest.approx(x.numel() * spec.bytes_per_value(x.dtype), abs=1e-9)
    # the payload is packed: bits/8 bytes per (padded) code
    padded = -(-x.shape[spec.axis] // spec.group) * spec.group
    assert q.payload.nbytes * 8 == x.numel() // x.shape[spec.axis] * padded * spec.bits


def test_bytes_per_value_figures():
    # KIVI int4, groups of 64, scale and zero point in a 16-bit dtype: 4 + 2·16/64 = 4.5 bits
    assert QuantSpec(4, 64, -2).bits_per_value(torch.float16) == 4.5
    assert QuantSpec(8, 64, -1, torch.bfloat16).bits_per_value(torch.float32) == 8.5
    assert QuantSpec(2, 32, -1).bits_per_value(torch.bfloat16) == 3.0
    assert QuantSpec(3, 64, -1).bits_per_value(torch.float16) == 3.5
    assert QuantSpec(16).bits_per_value(torch.float16) == 16
    assert QuantSpec(16).bits_per_value(torch.float32) == 32


@settings(max_examples=20, deadline=None)
@given(tensors(), st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
       st.sampled_from((-1, -2)))
def test_16_bits_is_identity(x, dtype, axis):
    x = x.to(dtype)
    spec = QuantSpec(16, 64, axis)
    q = quantize(x, spec)
    y = dequantize(q)
    assert y.dtype == x.dtype and torch.equal(y, x)
    assert q.nbytes == x.nbytes == spec.nbytes(x.shape, dtype)


def test_kivi_layouts_share_a_scale_where_they_should():
    x = torch.randn(2, 3, 128, 64)
    keys = quantize(x, QuantSpec.per_channel(4, 32))
    values = quantize(x, QuantSpec.per_token(4, 32))
    assert keys.scale.shape == (2, 3, 64, 4)  # per channel, 128 tokens / 32
    assert values.scale.shape == (2, 3, 128, 2)  # per token, 64 channels / 32


def test_constant_and_exactly_representable_groups():
    x = torch.full((4, 64), 3.25)
    assert torch.equal(dequantize(quantize(x, QuantSpec(2, 64))), x)
    codes = torch.arange(16.0).repeat(4, 4)  # integers 0..15: exact at 4 bits
    assert torch.equal(dequantize(quantize(codes, QuantSpec(4, 64, -1, torch.float16))), codes)


def _directed_reference(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """The nearest ``dtype`` value at or past ``x`` in the direction, by its definition:
    round to nearest, then one step by ``nextafter`` where that went the wrong way."""
    near = x.to(dtype)
    toward = torch.full_like(near, math.inf if up else -math.inf)
    stepped = torch.nextafter(near, toward)
    wrong = near.float() < x if up else near.float() > x
    return torch.where(wrong, stepped, near).float()


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_round_to_is_the_nearest_value_in_the_direction(dtype):
    info = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-30 if dtype == torch.float16 else -135, 16, (20000,),
                              generator=gen).float()
    x = (torch.rand(20000, generator=gen) + 1) * 2 ** exponents \
        * torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    # zero, the dtype's own values, its smallest normal and subnormal, binade edges
    edges = torch.tensor([0.0, info.tiny, info.smallest_normal * info.eps, 1.0, 2.0, 1024.0])
    x = torch.cat([x, edges, -edges, x.to(dtype).float(), x.to(dtype).float().nextafter(
        torch.tensor(math.inf))])
    x = x[x.abs() <= info.max * (1 - info.eps)]
    compiled = torch.compile(round_to, dynamic=False)
    for up in (False, True):
        expected = _directed_reference(x, dtype, up)
        assert torch.equal(round_to(x, dtype, up), expected)
        assert torch.equal(compiled(x, dtype, up), expected)


def test_invalid_specs_and_inputs():
    with pytest.raises(ValueError):
        QuantSpec(5, 64)
    with pytest.raises(ValueError):
        QuantSpec(3, 4)  # 12 bits: not whole bytes
    with pytest.raises(ValueError):
        quantize(torch.tensor([[1.0, float("nan")]]), QuantSpec(8, 2))
    with pytest.raises(OverflowError):
        quantize(torch.tensor([[-1e6, 0.0]]), QuantSpec(8, 2, -1, torch.float16))
    with pytest.raises(ValueError):
        QuantSpec(16).bytes_per_value()


# ---------------------------------------------------------------- channels split by width

@st.composite
def splits(draw):
    """A channel split of 1-4 runs of 1-5 channels at widths of QUANT_BITS, one group size
    that holds whole bytes of every width."""
    runs = tuple((draw(st.integers(1, 5)), draw(st.sampled_from(QUANT_BITS)))
                 for _ in range(draw(st.integers(1, 4))))
    group = 8 * draw(st.integers(1, 3))
    return ChannelSplit(runs, group, draw(st.sampled_from((None, torch.float16))))


@settings(max_examples=40, deadline=None)
@given(split=splits(), tokens=st.integers(1, 40), seed=st.integers(0, 2 ** 31 - 1))
def test_a_channel_split_is_its_runs_quantized_alone(split, tokens, seed):
    """Each run's codes are those of its channels quantized by its own spec, bit for bit;
    bytes are measured as predicted; the token-axis functions act run by run."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, tokens, split.width, generator=gen) * torch.logspace(1, -2, split.width)
    q = quantize(x, split)
    assert isinstance(q, SplitTensor) and q.shape == tuple(x.shape)
    parts = []
    for (at, channels, spec), part in zip(split.specs(), q.parts):
        alone = quantize(x[..., at:at + channels], spec)
        assert all(torch.equal(a, b) for a, b in zip(part.tensors, alone.tensors))
        parts.append(dequantize(alone))
    assert torch.equal(dequantize(q), torch.cat(parts, dim=-1))
    assert q.nbytes == split.nbytes(x.shape, x.dtype)
    whole = tokens // split.group * split.group
    if whole:
        cut = token_slots(q, whole, whole)
        assert token_count(cut) == whole
        assert torch.equal(dequantize(cut), dequantize(q)[..., :whole, :])
    picked = map_batch(q, lambda t: t[1:])
    assert torch.equal(dequantize(picked), dequantize(q)[1:])


def test_a_channel_split_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="at least one channel"):
        ChannelSplit((), 8)
    with pytest.raises(ValueError, match="bits must be one of"):
        ChannelSplit(((2, 5),), 8)
    with pytest.raises(ValueError, match="whole number of bytes"):
        ChannelSplit(((2, 3),), 4)
    with pytest.raises(ValueError, match="cannot hold 3"):
        quantize(torch.zeros(1, 1, 8, 3), ChannelSplit(((2, 4),), 8))
