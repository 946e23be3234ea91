"""Random product vector codes for the kernels' tests."""
from __future__ import annotations

import torch

from lorc_fx.codes.integer import pack_bits
from lorc_fx.codes.vector import BLOCK, rebuilt, unpacked_runs


def side(gen, batch: int, blocks: int, layout):
    """Random packed indices and tables of ``layout`` (runs of ``(sub-vectors, channels each,
    index bits)``), and the latent they decode to ``(batch, blocks·BLOCK, r)`` in float64."""
    payload, tables = [], []
    for subs, d, ib in layout:
        idx = torch.randint(0, 2 ** ib, (batch, subs, blocks, BLOCK), generator=gen)
        payload.append(pack_bits(idx, ib).flatten(-2))
        tables.append(torch.randn(subs, 2 ** ib, d, generator=gen))
    latent = rebuilt(unpacked_runs(payload, tables), [t.double() for t in tables])
    return payload, tables, latent
