"""The vector-coded cache ops (``cache.stores.vector_ops``) against ``codes.vector``'s encode
and decode, and torch's own checks of each op's registration (fake kernel, strides)."""
from __future__ import annotations

import torch
from torch.library import opcheck

from lorc_fx.cache.stores.vector_ops import (rewritten_blocks, vector_decode, vector_encode,
                                            vector_rewritten)
from lorc_fx.codes.vector import BLOCK, VectorBook, VectorSpec, decode, encode
from lorc_fx.kernels.nearest_codeword import distance_terms

# every index width a run can take: one channel at 5 bits, 4 at 2 (8-bit), 8 at 0.5 (4-bit)
SPEC = VectorSpec(((3, 5), (8, 2), (16, 0.5)), tuple_dims=8)


def _book(seed: int = 0) -> VectorBook:
    gen = torch.Generator().manual_seed(seed)
    tables = []
    for _, subs, d, ib in SPEC.layout():
        codewords = torch.randn(subs, 1 << ib, d, generator=gen)
        tables.append((codewords, codewords * 1.5))  # reconstructions unlike the codewords
    return VectorBook(SPEC, tuple(tables))


def test_the_ops_code_and_decode_as_the_codes_module():
    book = _book()
    codewords, values = book.codewords, book.reconstructions
    z = torch.randn(2, 3 * BLOCK, SPEC.width, generator=torch.Generator().manual_seed(1))
    payload = vector_encode(z, codewords)
    assert all(torch.equal(a, b) for a, b in zip(payload, encode(z, book).payload))
    torch.testing.assert_close(vector_decode(payload, values),
                               decode(encode(z, book), book), rtol=0, atol=0)
    opcheck(vector_encode, (z, codewords))
    opcheck(vector_decode, (payload, values))


def test_a_write_packs_its_tokens_into_their_blocks_and_keeps_the_others():
    """Static blocks rewritten for 5 tokens from token 6, then 1 at 11, and copied back:
    those tokens read their codes, every other slot keeps what it held."""
    book = _book(2)
    scaled, norms = (list(t) for t in zip(*map(distance_terms, book.codewords)))
    gen = torch.Generator().manual_seed(3)
    before = torch.randn(2, 4 * BLOCK, SPEC.width, generator=gen)
    blocks = [p.unflatten(-1, (4, -1)).clone() for p in encode(before, book).payload]
    expected = before.clone()
    for start, t in ((6, 5), (11, 1)):
        new = torch.randn(2, t, SPEC.width, generator=gen)
        at = torch.tensor(start)
        for codes, fresh in zip(blocks, vector_rewritten(blocks, new, scaled, norms, at)):
            codes.index_copy_(2, rewritten_blocks(at, t), fresh)
        expected[:, start:start + t] = new
    want = encode(expected, book).payload
    assert all(torch.equal(got.flatten(-2), w) for got, w in zip(blocks, want))
    opcheck(vector_rewritten, (blocks, new, scaled, norms, torch.tensor(11)))
