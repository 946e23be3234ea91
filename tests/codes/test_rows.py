"""Row codes (lorc_fx.codes.rows): exact when coded again, bounded error, bytes as said."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.codes.rows import RowSpec, encode, nbytes, packed, unpacked

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def rows(draw):
    """A tensor of rows of a few groups, magnitudes spread over many powers of two (some
    groups all zero), in a float dtype a cache holds."""
    dtype = draw(st.sampled_from(DTYPES))
    width = draw(st.sampled_from((8, 16, 24, 32, 48)))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, width, generator=g) * torch.exp2(torch.randint(-12, 8, (2, 3, 1),
                                                                         generator=g).float())
    x[0, 0] = 0
    return x.to(dtype)


@settings(max_examples=60, deadline=None)
@given(rows(), st.sampled_from((8, 4)), st.sampled_from((8, 16, 64)))
def test_decoded_rows_code_to_the_same_codes(x, bits, group):
    """What lets a cache layer rewrite rows it read back without drift: in every dtype, the
    decoded rows code again to the very codes and exponents, and decode to themselves."""
    spec = RowSpec(bits, group)
    first = encode(x, spec)
    decoded = first.decode()
    again = encode(decoded, spec)
    assert decoded.dtype == x.dtype and decoded.shape == x.shape
    assert torch.equal(again.codes, first.codes) and torch.equal(again.exponents, first.exponents)
    assert torch.equal(again.decode(), decoded)


@settings(max_examples=40, deadline=None)
@given(rows(), st.sampled_from((8, 4)))
def test_error_is_at_most_half_a_step_of_a_scale_below_twice_the_group_range(x, bits):
    spec = RowSpec(bits, 8)
    coded = encode(x, spec)
    top = (1 << (bits - 1)) - 1
    groups = x.float().reshape(*x.shape[:-1], -1, 8)
    scale = torch.exp2(coded.exponents.float())
    amax = groups.abs().amax(-1)
    coded_groups = amax > 0  # an all-zero group codes to zeros under any scale
    assert bool((scale[coded_groups] <= 2 * amax[coded_groups] / top).all())
    error = (coded.decode().float() - x.float()).reshape(groups.shape).abs().amax(-1)
    rounding = x.float().abs().reshape(groups.shape).amax(-1) * 2.0**-7  # the dtype's own
    assert bool((error <= scale / 2 + rounding).all())


@pytest.mark.parametrize("bits, width, group, expected", [
    (8, 16, 64, 8.5), (8, 512, 64, 8.125), (4, 32, 32, 4.25), (8, 24, 16, 8 + 8 / 12)])
def test_bytes_are_codes_and_one_exponent_byte_a_group(bits, width, group, expected):
    spec = RowSpec(bits, group)
    assert spec.bits_per_value(width) == pytest.approx(expected)
    x = torch.randn(3, 5, width)
    coded = encode(x, spec)
    measured = sum(t.numel() * t.element_size() for t in coded.tensors)
    assert measured == nbytes(x.shape, spec) == pytest.approx(x.numel() * expected / 8)


def test_a_bad_spec_says_what_is_valid():
    with pytest.raises(ValueError, match=r"row codes take bits \(8, 4\), not 3"):
        RowSpec(3, 16)
    with pytest.raises(ValueError, match="even number of values"):
        RowSpec(8, 7)


@pytest.mark.parametrize("bits, width", [(8, 16), (8, 128), (4, 48)])
def test_packed_rows_are_one_tensor_that_concatenates_and_unpacks(bits, width):
    """What an indexer's keys are kept as: one byte tensor per row, so a cache concatenates,
    reorders and selects them as any tensor, and reads back the same values."""
    spec = RowSpec(bits, 64)
    a, b = torch.randn(2, 3, 4, width), torch.randn(2, 5, 4, width)
    joined = torch.cat([packed(encode(a, spec)), packed(encode(b, spec))], dim=1)
    assert joined.dtype == torch.uint8 and joined.shape[:-1] == (2, 8, 4)
    back = unpacked(joined.index_select(0, torch.tensor([1, 0])), spec, width, torch.float32)
    expected = torch.cat([encode(a, spec).decode(), encode(b, spec).decode()], dim=1)[[1, 0]]
    assert torch.equal(back.decode(), expected)
