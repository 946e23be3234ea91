"""The C++ kernel of ``lorc::vector_scores`` / ``vector_sums`` (product vector codes read by
table lookups, value sums over blocks decoded in L1) against float64 maths over the codes
decoded."""
from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers.vector_codes import side
from lorc_fx.codes.vector import BLOCK
from lorc_fx.kernels import vector_reductions
from lorc_fx.kernels.nearest_codeword import distance_terms

native = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                            reason="the kernel is built for x86-64")
# a run: (sub-vectors, channels each, index bits); every index width 1..8 bits
runs = st.lists(st.tuples(st.integers(1, 5), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 8)),
                min_size=1, max_size=4)


def assert_float32_close(got, weights, values, terms: int):
    """``got`` within float32 rounding of ``weights @ values`` (float64): sums of at most
    ``terms`` float32 terms, each at most ``|weight|·|value|``."""
    bound = (terms + 4) * 2.0 ** -24 * (weights.abs() @ values.abs()) + 1e-30
    error = (got.double() - weights @ values).abs()
    assert (error <= bound).all(), (error.max(), bound.min())


@native
def test_the_kernel_builds_here():
    assert vector_reductions._library() is not None


@native
@settings(max_examples=30, deadline=None)
@given(layout=runs, batch=st.integers(1, 3), blocks=st.integers(1, 12), rows=st.sampled_from([1, 3, 9, 16, 40]),
       threads=st.sampled_from([1, 2, 5]), seed=st.integers(0, 99))
def test_scores_and_sums_are_those_of_the_decoded_latent(layout, batch, blocks, rows, threads,
                                                         seed):
    """Any runs of any index width (2- and 4-bit indices pack in runs, the others as one word
    a block), any number of blocks, split over more threads than blocks or fewer."""
    gen = torch.Generator().manual_seed(seed)
    payload, tables, latent = side(gen, batch, blocks, layout)
    q = torch.randn(batch, rows, latent.shape[-1], generator=gen)
    p = torch.rand(batch, rows, blocks * BLOCK, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scores = vector_reductions.vector_scores(q, payload, tables)
        sums = vector_reductions.vector_sums(p, payload, tables)
    finally:
        torch.set_num_threads(previous)
    assert_float32_close(scores, q.double(), latent.transpose(1, 2), latent.shape[-1])
    assert_float32_close(sums, p.double(), latent, blocks * BLOCK + 256)


@native
@settings(max_examples=30, deadline=None)
@given(layout=runs, batch=st.integers(1, 3), blocks=st.integers(1, 12),
       threads=st.sampled_from([1, 2, 5]), seed=st.integers(0, 99))
def test_the_decode_copies_every_slots_reconstructions(layout, batch, blocks, threads, seed):
    """``lorc::vector_decode``'s kernel: the latent the tensor maths decode, bit for bit, for
    any runs, blocks and threads (more threads than blocks too)."""
    payload, tables, latent = side(torch.Generator().manual_seed(seed), batch, blocks, layout)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = vector_reductions.decoded(payload, tables)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, latent.float())


@native
@settings(max_examples=30, deadline=None)
@given(layout=runs, batch=st.integers(1, 2), blocks=st.integers(1, 9),
       rows=st.sampled_from([1, 3, 9, 13, 40]),
       pairs=st.integers(1, 40), threads=st.sampled_from([1, 2, 5]), seed=st.integers(0, 99))
def test_turned_scores_are_those_of_the_decoded_latent_turned(layout, batch, blocks, rows, pairs,
                                                              threads, seed):
    """``lorc::vector_turned_scores``: each slot's latent, every channel times its pair's
    cosine and sine at that slot, dotted with each row's ``(α, β)``."""
    gen = torch.Generator().manual_seed(seed)
    payload, tables, latent = side(gen, batch, blocks, layout)
    r, slots = latent.shape[-1], blocks * BLOCK
    pair = torch.randint(0, pairs, (r,), generator=gen)
    cos, sin = (torch.randn(batch, slots, pairs, generator=gen) for _ in range(2))
    ab = torch.randn(batch, rows, 2 * r, generator=gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = vector_reductions.vector_turned_scores(ab, cos, sin, pair, payload, tables)
    finally:
        torch.set_num_threads(previous)
    turned = torch.cat((latent * cos.double()[..., pair], latent * sin.double()[..., pair]), -1)
    assert_float32_close(got, ab.double(), turned.transpose(1, 2), 2 * r + 1)


@native
def test_turned_scores_refuse_pairs_not_one_a_channel():
    """A pairs tensor of another length than the latent's width is refused, naming the width
    (the kernel would read past it)."""
    payload, tables, latent = side(torch.Generator().manual_seed(0), 1, 2, [(2, 4, 3)])
    r = latent.shape[-1]
    cos = sin = torch.zeros(1, 2 * BLOCK, 4)
    with pytest.raises(ValueError, match=f"pairs of shape \\({r},\\)"):
        vector_reductions.vector_turned_scores(torch.zeros(1, 1, 2 * r), cos, sin,
                                               torch.zeros(r - 1, dtype=torch.int32),
                                               payload, tables)


@native
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_turned_scores_of_a_side_read_its_window_and_sink_as_floats(style):
    """``_VectorPositions.turned_scores``: the kernel's slots, then the window's rows and each
    row's sink turned at their own positions, as ``per_frequency_scores`` over the side's
    latent in position order (``values``)."""
    from lorc_fx.compile import latent_attention, quantized_attention

    gen = torch.Generator().manual_seed(1)
    payload, tables, latent = side(gen, 2, 5, [(3, 2, 5), (2, 4, 8), (4, 1, 3)])
    r = latent.shape[-1]
    window = torch.randn(2, 1, 6, r, generator=gen)
    sink = torch.randn(2, 1, 1, r, generator=gen)
    sides = quantized_attention.positions(("vector", payload, tables, window, 32, 36, sink,
                                           torch.tensor([0, 3])))
    rotary_dim = 8
    pairs = torch.randint(0, rotary_dim // 2, (r,), generator=gen).tolist()
    positions = sides.slots + 6
    angles = torch.rand(2, positions, rotary_dim // 2, generator=gen) * 6
    per_dim = (lambda x: torch.cat((x, x), -1)) if style == "half" else \
        (lambda x: x.repeat_interleave(2, -1))
    cos, sin = per_dim(angles.cos()), per_dim(angles.sin())
    ab = torch.randn(2, 4, 2 * r, generator=gen)
    got = sides.turned_scores(ab, cos, sin, style, pairs)
    values = sides.values()[:, 0].float()
    expected = ab @ latent_attention.turned(values, cos, sin, style, pairs).transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_kernel_packs_blocks_as_the_codes_do():
    assert vector_reductions.BLOCK == BLOCK


@native
def test_the_sums_refuse_sub_vectors_the_decode_does_not_copy():
    """The sums decode each block, by copies of 1, 2, 4, 8 or 16 channels (all that the codes
    make): any other width is refused, naming the widths, rather than summed wrong."""
    payload, tables, _ = side(torch.Generator().manual_seed(0), 1, 2, [(2, 3, 2)])
    with pytest.raises(ValueError, match=r"\(1, 2, 4, 8, 16\) channels, not \[3\]"):
        vector_reductions.vector_sums(torch.rand(1, 2, 2 * BLOCK), payload, tables)


@native
def test_without_the_kernel_attention_decodes_and_multiplies(monkeypatch):
    """Where the kernel does not serve (another device, no compiler) ``_VectorPositions``
    multiplies the codes decoded: the scores and sums the kernel gives, a sink read by its
    latent, window rows after the codes."""
    from lorc_fx.compile import quantized_attention

    gen = torch.Generator().manual_seed(0)
    payload, tables, latent = side(gen, 2, 5, [(3, 2, 5), (2, 4, 8), (4, 1, 3)])
    window = torch.randn(2, 1, 6, latent.shape[-1], generator=gen)
    sink = torch.randn(2, 1, 1, latent.shape[-1], generator=gen)
    sides = quantized_attention.positions(("vector", payload, tables, window, 32, 36, sink,
                                           torch.tensor([0, 3])))
    q = torch.randn(2, 1, 4, latent.shape[-1], generator=gen)
    p = torch.rand(2, 1, 4, sides.slots + 6, generator=gen)
    by_kernel = sides.scores(q), sides.sums(p)
    monkeypatch.setattr(vector_reductions, "native_applies", lambda device: False)
    decoded = sides.scores(q), sides.sums(p)
    for got, expected in zip(by_kernel, decoded):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the sink's position reads its latent: row 1's at token 3
    torch.testing.assert_close(decoded[0][1, 0, :, 3], (q[1, 0] @ sink[1, 0, 0]),
                               atol=1e-4, rtol=1e-4)


@native
@settings(max_examples=25, deadline=None)
@given(layout=runs, batch=st.integers(1, 2), blocks=st.integers(2, 6), tokens=st.integers(1, 9),
       seed=st.integers(0, 99))
def test_the_static_write_packs_the_indices_the_tensor_maths_packs(layout, batch, blocks, tokens,
                                                                  seed):
    """``lorc::vector_rewritten`` by the kernel: the blocks the tensor maths gives (each
    token's nearest codeword as ``lorc::nearest_codeword`` picks it, packed over the others),
    for a write of any length from any offset."""
    from lorc_fx.cache.stores import vector_ops

    gen = torch.Generator().manual_seed(seed)
    layout = [(subs, d, ib) for subs, d, ib in layout if d in (1, 2, 4, 8, 16)]
    payload, tables, _ = side(gen, batch, blocks + 2, layout)
    payload = [p.unflatten(-1, (blocks + 2, -1)) for p in payload]  # (b, S, blocks, bytes)
    width = sum(subs * d for subs, d, _ in layout)
    z = torch.randn(batch, tokens, width, generator=gen)
    start = torch.tensor(int(torch.randint(0, blocks * BLOCK - tokens + 1, (1,), generator=gen)))
    terms = [list(t) for t in zip(*map(distance_terms, tables))]  # -2c, |c|² a run
    assert vector_reductions.rewritten(payload, z, *terms, int(start), -(-tokens // BLOCK) + 1)
    got = vector_ops.vector_rewritten(payload, z, *terms, start)
    vector_reductions_rewritten = vector_reductions.rewritten
    try:
        vector_reductions.rewritten = lambda *args: None
        expected = vector_ops.vector_rewritten(payload, z, *terms, start)
    finally:
        vector_reductions.rewritten = vector_reductions_rewritten
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
