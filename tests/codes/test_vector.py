"""Product vector codes (lorc_fx.codes.vector): layout, bit-exact round trip, bytes,
nearest codewords, fitting and cutting an allocation's book from per-width books."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.codes.vector import (BLOCK, TAIL_REACH, VECTOR_WIDTHS, VectorBook, VectorSpec, decode,
                                  encode, fit, fit_measured, kmeans, nearest, reconstruction,
                                  select, sub_dims)

WIDTHS = VECTOR_WIDTHS + (4, 5, 6)


@st.composite
def specs(draw):
    tuple_dims = draw(st.sampled_from((2, 4, 8)))
    runs = []
    for _ in range(draw(st.integers(1, 3))):
        bits = draw(st.sampled_from(WIDTHS))
        runs.append((sub_dims(bits, tuple_dims) * draw(st.integers(1, 3)), bits))
    return VectorSpec(tuple(runs), tuple_dims)


def _book_of_distinct_codewords(spec: VectorSpec, gen: torch.Generator) -> VectorBook:
    """Random codewords at least 0.5 apart (their first channels a shuffled grid of step
    0.5), so float rounding in the distances can never make another one the nearest."""
    tables = []
    for _, subs, d, ib in spec.layout():
        codewords = torch.randn(subs, 1 << ib, d, generator=gen) * 3
        codewords[..., 0] = torch.stack([torch.randperm(1 << ib, generator=gen)
                                         for _ in range(subs)]) * 0.5
        tables.append((codewords, codewords))
    return VectorBook(spec, tuple(tables))


@settings(max_examples=60, deadline=None)
@given(specs(), st.integers(1, 3), st.integers(1, 21), st.integers(0, 2 ** 31 - 1))
def test_codewords_round_trip_bit_exact_and_bytes_are_the_specs(spec, batch, tokens, seed):
    """A latent made of codewords comes back exactly (every index width, partial blocks),
    and the codes hold the spec's bytes: its bits per token once the tokens fill blocks."""
    gen = torch.Generator().manual_seed(seed)
    book = _book_of_distinct_codewords(spec, gen)
    parts = []
    for (_, subs, d, ib), (codewords, _) in zip(spec.layout(), book.tables):
        idx = torch.randint(0, 1 << ib, (batch, subs, tokens), generator=gen)
        parts.append(codewords[torch.arange(subs)[:, None], idx].transpose(1, 2)
                     .reshape(batch, tokens, subs * d))
    z = torch.cat(parts, dim=-1)
    codes = encode(z, book)
    assert torch.equal(decode(codes, book), z)
    assert all(p.dtype == torch.uint8 for p in codes.payload)
    assert codes.nbytes == spec.nbytes(batch, tokens)
    whole = -(-tokens // BLOCK) * BLOCK
    assert codes.nbytes * 8 == batch * whole * spec.bits_per_token()


@settings(max_examples=40, deadline=None)
@given(specs(), st.lists(st.integers(1, 3), min_size=2, max_size=4), st.integers(0, 2 ** 31 - 1))
def test_blocks_coded_apart_concatenate_and_cut_as_the_codes_of_them_all(spec, pieces, seed):
    """A cache codes its latents a block at a time and keeps the payloads side by side: they
    decode as the codes of all the tokens at once, and a prefix of whole blocks cut from them
    decodes as the codes of that prefix (every index width: a 4-bit index packed over the
    whole token axis would interleave blocks)."""
    gen = torch.Generator().manual_seed(seed)
    book = _book_of_distinct_codewords(spec, gen)
    z = torch.randn(2, sum(pieces) * BLOCK, spec.width, generator=gen) * 3
    whole = encode(z, book)
    starts = [sum(pieces[:i]) * BLOCK for i in range(len(pieces) + 1)]
    apart = [encode(z[:, a:b], book) for a, b in zip(starts, starts[1:])]
    payload = tuple(torch.cat(parts, dim=-1) for parts in zip(*(c.payload for c in apart)))
    assert all(torch.equal(p, q) for p, q in zip(payload, whole.payload))
    keep = pieces[0] * BLOCK
    prefix = type(whole)(spec, tuple(p[..., :p.shape[-1] * keep // z.shape[1]]
                                     for p in whole.payload), keep)
    assert torch.equal(decode(prefix, book), decode(encode(z[:, :keep], book), book))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from((1, 2, 4, 8)), st.integers(2, 40), st.integers(0, 2 ** 31 - 1))
def test_nearest_is_the_least_squared_distance(d, count, seed):
    gen = torch.Generator().manual_seed(seed)
    codewords = torch.randn(3, count, d, generator=gen)
    x = torch.randn(2, 3, 50, d, generator=gen)
    dist = ((x[..., :, None, :] - codewords[:, None]) ** 2).sum(-1)  # (2, 3, 50, count)
    idx = nearest(x, codewords)
    picked = dist.gather(-1, idx[..., None])[..., 0]
    # float32 rounding of ||c||² - 2x·c is ~1e-5 at these sizes: a wrong pick is farther
    assert torch.allclose(picked, dist.amin(-1), atol=1e-4)


def test_kmeans_finds_well_separated_clusters():
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 4, 2, generator=gen) * 10
    x = centres.repeat_interleave(50, dim=1) + 0.01 * torch.randn(2, 200, 2, generator=gen)
    books = kmeans(x, 4, iters=20)
    err = ((x - books.gather(1, nearest(x, books)[..., None].expand(-1, -1, 2))) ** 2).mean()
    assert err < 1e-3


def test_kmeans_coarse_steps_read_a_quarter_of_the_samples_and_fit_as_well():
    """Two thirds of the steps assign a quarter of the samples, the rest all of them; the
    codewords' error is within a few percent of as many steps on all samples, and a sample
    set too small for a quarter to give each codeword 4 samples takes every step on all."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4096, 4, generator=gen) * torch.tensor([3.0, 1.0, 0.5, 0.1])
    seen = []

    def recording(samples, books):
        seen.append(samples.shape[1])
        return nearest(samples, books)

    books = kmeans(x, 64, iters=15, assign=recording)
    assert seen == [1024] * 10 + [4096] * 5
    error = lambda b: float(((x - b.gather(1, nearest(x, b)[..., None].expand(-1, -1, 4)))
                             ** 2).mean())
    every_step = x[:, torch.randperm(4096, generator=torch.Generator().manual_seed(0))[:64]]
    for _ in range(15):  # the same start, every step on all samples
        idx = nearest(x, every_step)
        sums = torch.zeros_like(every_step).scatter_add_(1, idx[..., None].expand(-1, -1, 4), x)
        counts = torch.zeros(2, 64).scatter_add_(1, idx, torch.ones(2, 4096))
        every_step = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None],
                                 every_step)
    assert error(books) < 1.05 * error(every_step)
    seen.clear()
    kmeans(x[:, :1000], 64, iters=6, assign=recording)
    assert seen == [1000] * 6


@pytest.mark.parametrize("iters", (0, 1, 4))
def test_scalar_lloyd_steps_as_the_nearest_level_assigns(iters):
    """In one dimension k-means sorts the samples once and sums between midpoints; each step
    is the generic one (every sample to its nearest level, :func:`nearest`, the means kept
    where a level has samples) from the same quantile start, and the levels stay sorted."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 500, 1, generator=gen) * torch.tensor([1.0, 4.0, 0.1])[:, None, None]
    x[0, :200] = 0.5  # a dense channel: equal quantiles, levels without samples
    at = (torch.arange(8, dtype=x.dtype) + 0.5) / 8
    want = torch.quantile(x[..., 0], at, dim=1).T[..., None].contiguous()
    for _ in range(iters):
        idx = nearest(x, want)
        sums = torch.zeros_like(want).scatter_add_(1, idx[..., None], x)
        counts = torch.zeros(3, 8).scatter_add_(1, idx, torch.ones(3, 500))
        want = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], want)
    got = kmeans(x, 8, iters=iters)
    assert torch.allclose(got, want, atol=1e-5)
    assert (got.diff(dim=1) >= 0).all()


def test_a_fit_measures_the_coding_errors_its_book_reconstructs():
    gen = torch.Generator().manual_seed(3)
    samples = torch.randn(1500, 24, generator=gen) * torch.linspace(2, 0.2, 24)
    spec = VectorSpec(((8, 1), (8, 2), (8, 5)))
    book, squared = fit_measured(samples, spec)
    want = ((reconstruction(samples, book) - samples).double() ** 2).sum(0)
    assert squared.dtype == torch.float64
    torch.testing.assert_close(squared, want)


def test_fit_lowers_the_error_of_its_start_and_keeps_variance():
    gen = torch.Generator().manual_seed(1)
    samples = torch.randn(2000, 16, generator=gen) * torch.linspace(3, 0.1, 16)
    spec = VectorSpec(((8, 1), (8, 2)))
    z = samples[None]
    plain = fit(samples, spec, keep_variance=False, iters=0)  # the drawn samples themselves
    fitted = fit(samples, spec, keep_variance=False)
    err = lambda book: float(((decode(encode(z, book), book) - z) ** 2).mean())
    assert err(fitted) < err(plain)
    book = fit(samples, spec, keep_variance=True)
    kept = decode(encode(z, book), book)[0]
    assert torch.allclose(kept.var(0), samples.var(0), rtol=1e-3)


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_tails_keep_levels_past_the_range_and_code_drifted_values_closer(bits):
    """With ``tails`` a 4- to 6-bit scalar table keeps its size, its inner levels are a Lloyd
    fit of fewer levels inside the samples' range and ``TAIL_REACH`` of that range lies past
    each end; values drifted past the range code closer than as the outermost fitted level,
    and the samples themselves little worse. Vector widths are fitted as before."""
    gen = torch.Generator().manual_seed(4)
    samples = torch.randn(3000, 8, generator=gen) * torch.linspace(2, 0.5, 8)
    spec = VectorSpec(((8, bits),))
    plain_book, plain_err = fit_measured(samples, spec, keep_variance=False)
    book, err = fit_measured(samples, spec, keep_variance=False, tails=True)
    levels, plain_levels = book.tables[0][0][..., 0], plain_book.tables[0][0][..., 0]
    reach = torch.tensor(TAIL_REACH[1 << bits])
    low, high = samples.amin(0), samples.amax(0)
    assert levels.shape == plain_levels.shape
    assert (plain_levels >= low[:, None]).all() and (plain_levels <= high[:, None]).all()
    span, t = (high - low)[:, None], len(reach)
    torch.testing.assert_close(levels[:, -t:] - levels[:, -t - 1:-t], span * reach)
    torch.testing.assert_close(levels[:, t:t + 1] - levels[:, :t], span * reach.flip(0))
    assert (levels[:, -1] > high).all() and (levels[:, 0] < low).all()
    drifted = (high + 0.4 * (high - low))[None]  # past every channel's range
    code = lambda b: decode(encode(drifted[None], b), b)[0]
    assert ((code(book) - drifted).abs() < (code(plain_book) - drifted).abs()).all()
    assert err.sum() < 1.5 * plain_err.sum()
    vector = VectorSpec(((8, 2),))
    assert all(torch.equal(a, b) for a, b in zip(fit(samples, vector, tails=True).tables[0],
                                                 fit(samples, vector).tables[0]))


def test_select_cuts_an_allocation_from_per_width_books():
    gen = torch.Generator().manual_seed(2)
    samples = torch.randn(600, 32, generator=gen)
    books = {b: fit(samples, VectorSpec(((32, b),)), iters=3) for b in (1, 2, 4)}
    bits = [2] * 8 + [0] * 8 + [1] * 8 + [4] * 8
    book, kept = select(books, bits)
    assert kept.tolist() == list(range(8)) + list(range(16, 32))
    assert book.spec.runs == ((8, 2), (8, 1), (8, 4))
    z = samples[None, :40]
    part = decode(encode(z[..., kept], book), book)
    wholes = {b: decode(encode(z, books[b]), books[b]) for b in books}  # every channel at b
    for i, c in enumerate(kept.tolist()):
        assert torch.equal(part[..., i], wholes[bits[c]][..., c])


@pytest.mark.parametrize("bits", (0.25, 3.5, 0, 9))
def test_widths_outside_the_codes_refuse_naming_the_valid_ones(bits):
    with pytest.raises(ValueError, match="bits per channel must be one of"):
        sub_dims(bits)


def test_a_run_must_be_whole_sub_vectors():
    with pytest.raises(ValueError, match="not a whole number of 8-channel sub-vectors"):
        VectorSpec(((12, 1),))
    with pytest.raises(ValueError, match="does not start a 8-channel sub-vector"):
        select({1: fit(torch.randn(300, 16), VectorSpec(((16, 1),)), iters=1)}, [0] * 4 + [1] * 8 + [0] * 4)
