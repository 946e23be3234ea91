"""``lorc::vector_scores`` / ``vector_sums`` (``kernels.vector_reductions``) for CUDA tensors, in
Triton: the same two reductions over product vector codes, the codes read and never decoded.

A side's codes are runs (``vector_reductions``' docstring): run ``u`` holds ``S`` sub-vectors
of ``d`` channels with ``K = 2^ib`` codewords each (its table ``(S, K, d)``), and a token's
``ib``-bit index per sub-vector, packed per sub-vector in blocks of 8 tokens (``ib`` bytes a
block; ``codes.integer.pack_bits``: 1-, 2-, 4- and 8-bit indices at bit ``ib·(i // ib)`` of
byte ``i % ib``, 3, 5, 6 and 7 bits as one little-endian word a block). Each run is one launch:

- scores: torch first forms each codeword's dot products with the query rows, ``table_q (b, S,
  K, M)`` (``M·S·K·d`` multiply-adds, small); the kernel then adds, for every slot, the
  ``M``-row of each of its sub-vectors' entries: one gather a sub-vector, no latent.
- sums: one program a sub-vector (and a share of the slots) sums the weights of the slots that
  picked each codeword, ``hist (K, M)``, as a product of the slots' one-hot rows with their
  weights (``tl.dot`` in ``ieee`` float32, not TF32, which would round the weights: each
  product is then a weight or zero); torch then multiplies the per-split sums with the
  tables.

Results are float32 and sum in another order than the C++ kernel. Checked against float64
under the Triton interpreter (``tests/kernels/test_vector_triton.py``) and, where a GPU is
lent, on it (``bench/gpu``). Not timed on a GPU yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 8  # tokens whose indices pack together (``codes.vector.BLOCK``; a test checks)
SLOTS = 64  # slots a program takes at a time
SPLIT_SLOTS = 1024  # slots one sums program covers at most (then the splits are added)


@triton.jit
def _indices(row, n, live, IB: tl.constexpr, WHOLE: tl.constexpr):
    """Indices of slots ``n`` of one sub-vector whose packed blocks start at ``row``."""
    k, i = n // 8, n % 8
    if WHOLE:  # 1, 2, 4 or 8 bits: one byte holds each code whole
        byte = tl.load(row + k * IB + i % IB, mask=live, other=0).to(tl.int32)
        return (byte >> (IB * (i // IB))) & ((1 << IB) - 1)
    else:  # a little-endian word a block: a code may reach into the next byte
        bit = IB * i
        at = row + k * IB + bit // 8
        low = tl.load(at, mask=live, other=0).to(tl.int32)
        high = tl.load(at + 1, mask=live & (bit % 8 + IB > 8), other=0).to(tl.int32)
        return ((low | (high << 8)) >> (bit % 8)) & ((1 << IB) - 1)


@triton.jit
def _scores_kernel(table_q, payload, out, S, K, M, slots, blocks, stride_out_b, stride_out_m,
                   IB: tl.constexpr, WHOLE: tl.constexpr, ACCUMULATE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``out[b, m, n] (+)= Σ_s table_q[b, s, index(b, s, n), m]`` for one run."""
    b, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    live, rows = n < slots, m < M
    both = live[:, None] & rows[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for s in range(S):
        index = _indices(payload + (b * S + s) * blocks * IB, n, live, IB, WHOLE)
        entry = ((b * S + s) * K + index).to(tl.int64) * M
        acc += tl.load(table_q + entry[:, None] + m[None, :], mask=both, other=0.0)
    at = out + b * stride_out_b + m[None, :] * stride_out_m + n[:, None]
    if ACCUMULATE:
        acc += tl.load(at, mask=both, other=0.0)
    tl.store(at, acc, mask=both)


@triton.jit
def _sums_kernel(p, payload, hist, S, M, slots, blocks, per_split, stride_p_b, stride_p_m,
                 IB: tl.constexpr, WHOLE: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """``hist[b, split, s, k, m] = Σ_{n in split, index(b, s, n) = k} p[b, m, n]``."""
    b, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    k, m = tl.arange(0, KP), tl.arange(0, BLOCK_M)
    rows = m < M
    end = tl.minimum((split + 1) * per_split, slots)
    acc = tl.zeros((KP, BLOCK_M), dtype=tl.float32)
    for n0 in range(split * per_split, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < end
        index = _indices(payload + (b * S + s) * blocks * IB, n, live, IB, WHOLE)
        picked = ((index[:, None] == k[None, :]) & live[:, None]).to(tl.float32)  # (N, KP)
        w = tl.load(p + b * stride_p_b + m[None, :] * stride_p_m + n[:, None],
                    mask=live[:, None] & rows[None, :], other=0.0)  # (N, M)
        acc += tl.dot(tl.trans(picked), w, input_precision="ieee")
    at = hist + (((b * splits + split) * S + s) * KP + k[:, None]) * BLOCK_M + m[None, :]
    tl.store(at, acc)


def _runs(payload: list[Tensor], tables: list[Tensor]):
    """Each run's packed indices, table, index bits and first channel; and the blocks."""
    first, runs = 0, []
    for codes, table in zip(payload, tables):
        subs, count, d = (int(n) for n in table.shape)
        runs.append((codes.contiguous(), table.float(), count.bit_length() - 1, first))
        first += subs * d
    blocks = payload[0].shape[-1] // runs[0][2]
    return runs, blocks


def _rows_block(m: int) -> int:
    return max(16, triton.next_power_of_2(m))  # tl.dot's smallest side


def scores(q: Tensor, payload: list[Tensor], tables: list[Tensor]) -> Tensor:
    """``q (b, m, r)`` against every slot of the codes: ``(b, m, blocks·BLOCK)``, float32."""
    b, m, _ = q.shape
    runs, blocks = _runs(payload, tables)
    slots = blocks * BLOCK
    out = torch.empty(b, m, slots, dtype=torch.float32, device=q.device)
    q = q.float()
    for u, (codes, table, ib, first) in enumerate(runs):
        subs, count, d = table.shape
        table_q = torch.einsum("bmsd,skd->bskm",
                               q[..., first:first + subs * d].reshape(b, m, subs, d),
                               table).contiguous()
        _scores_kernel[(b, triton.cdiv(slots, SLOTS))](
            table_q, codes, out, subs, count, m, slots, blocks, out.stride(0), out.stride(1),
            IB=ib, WHOLE=ib in (1, 2, 4, 8), ACCUMULATE=u > 0, BLOCK_N=SLOTS,
            BLOCK_M=_rows_block(m))
    return out


def sums(p: Tensor, payload: list[Tensor], tables: list[Tensor]) -> Tensor:
    """``Σ_slot p·latent`` for weights ``p (b, m, blocks·BLOCK)`` (any strides but the last):
    ``(b, m, r)``, float32."""
    b, m, _ = p.shape
    runs, blocks = _runs(payload, tables)
    slots = blocks * BLOCK
    p = p.float()
    if p.stride(-1) != 1:
        p = p.contiguous()
    rows = _rows_block(m)
    splits = triton.cdiv(slots, SPLIT_SLOTS)
    per_split = triton.cdiv(triton.cdiv(slots, splits), SLOTS) * SLOTS
    parts = []
    for codes, table, ib, _ in runs:
        subs, count, d = table.shape
        width = max(16, count)
        hist = torch.empty(b, splits, subs, width, rows, dtype=torch.float32, device=p.device)
        _sums_kernel[(b, subs, splits)](
            p, codes, hist, subs, m, slots, blocks, per_split, p.stride(0), p.stride(1),
            IB=ib, WHOLE=ib in (1, 2, 4, 8), KP=width, BLOCK_N=SLOTS, BLOCK_M=rows)
        per_entry = hist.sum(1)[:, :, :count, :m]  # (b, S, K, m)
        parts.append(torch.einsum("bskm,skd->bmsd", per_entry, table).reshape(b, m, subs * d))
    return torch.cat(parts, dim=-1)
