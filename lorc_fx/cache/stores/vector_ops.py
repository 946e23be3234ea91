"""A vector-coded cache side's steps as ops, so a compiled decode step holds a call or two a
side instead of every run's unpacking, gathers and packing traced out:

- ``lorc::vector_encode(z (b, n, r), codewords)``: each run's packed indices ``(b, S,
  blocks·index bytes)`` of ``n`` (a whole number of blocks) tokens;
- ``lorc::vector_decode(payload, values)``: the latents ``(b, blocks·BLOCK, r)`` of every
  block of slots, in the reconstructions' dtype;
- ``lorc::vector_latents(payload, values, window, coded, tokens, sink, sink_at, means,
  chunk, ring_from, ring_to)``: what attention reads of a side, every token's latent ``(b, 1,
  tokens, r)``: the first ``coded`` decoded (each plus its chunk's drift offset,
  ``stores.drift``), then the window's rows (or, where the window is a static store's ring,
  the positions from ``ring_from`` to ``ring_to`` read from it), each row's sink written over
  its position; decode steps read the codes themselves instead
  (``compile.quantized_attention`` finds this op);
- ``lorc::vector_rewritten(payload, z (b, t, r), scaled, norms, start)``: the blocks of a static
  store's ``(b, S, blocks, index bytes)`` that ``t`` tokens written from token ``start`` (a
  0-d tensor) reach, their indices packed in; the store copies them back in place.

``codewords`` / ``values`` are a book's per-run tables ``(S, K, d)``; they alone say the
layout (``codes.vector.layout_of``). Why ops: traced out, a side's runs (4 to 5 a side on the
default model's 2.56-bit plan) lowered to a C++ kernel each for their shifts, masks, gathers
and splices: a two-layer cut of that model took 292 s to its first compiled ``generate`` on
the 2-core machine, 79 s with the ops, and the whole model did not finish compiling in 22
minutes, 5 to 8 with them (bench/results/long_context_vector-cpu.md). Each body is the eager
maths of ``codes.vector``, so an op computes what the traced steps did, bit for bit.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from lorc_fx.codes.integer import pack_bits, unpack_bits
from lorc_fx.codes.vector import (BLOCK, layout_of, packed_runs, rebuilt, run_indices,
                                  unpacked_runs)
from lorc_fx.kernels import vector_reductions
from lorc_fx.kernels.nearest_codeword import nearest_codeword

from . import drift


@custom_op("lorc::vector_encode", mutates_args=())
def vector_encode(z: Tensor, codewords: list[Tensor]) -> list[Tensor]:
    """Packed indices per run of latents ``z (b, n, r)``, ``n`` whole blocks."""
    if z.shape[1] % BLOCK:
        raise ValueError(f"vector_encode codes whole blocks of {BLOCK} tokens, not {z.shape[1]}")
    return [p.contiguous() for p in
            packed_runs(run_indices(z.float(), codewords, nearest_codeword), codewords)]


@vector_encode.register_fake
def _(z, codewords):
    b, n, _ = z.shape
    return [z.new_empty(b, subs, n // BLOCK * ib, dtype=torch.uint8)
            for _, subs, _, ib in layout_of(codewords)]


@custom_op("lorc::vector_decode", mutates_args=())
def vector_decode(payload: list[Tensor], values: list[Tensor]) -> Tensor:
    """The latents ``(b, blocks·BLOCK, r)`` of every block of ``payload``."""
    by_kernel = vector_reductions.decoded(payload, values)
    if by_kernel is not None:
        return by_kernel.to(values[0].dtype)
    return rebuilt(unpacked_runs(payload, values), values).contiguous()


@vector_decode.register_fake
def _(payload, values):
    (*_, ib), width = layout_of(values)[0], sum(v.shape[0] * v.shape[2] for v in values)
    b, _, nbytes = payload[0].shape
    return payload[0].new_empty(b, nbytes // ib * BLOCK, width, dtype=values[0].dtype)


def token_positions(at: Tensor, coded: int, slots: int, rows: int = 0,
                    ring_from: Tensor | None = None, ring_to: Tensor | None = None) -> Tensor:
    """Where each of the tokens ``at`` sits among a side's positions, the codes' ``slots``
    (spare ones included) then the window's ``rows``: the first ``coded`` tokens in their
    slots and the rest in the window's rows in turn; or, where ``ring_to`` is given (every
    token coded, the window a ring), tokens ``ring_from`` to ``ring_to`` at row ``p % rows``
    and every other in its slot. The one map both the latents rebuilt (``vector_latents``)
    and attention over the codes read."""
    if ring_to is None:
        return torch.where(at < coded, at, at - coded + slots)
    return torch.where(in_ring(at, ring_from, ring_to), at % rows + slots, at)


def in_ring(at: Tensor, ring_from: Tensor, ring_to: Tensor) -> Tensor:
    """Which of the tokens (or slots) ``at`` a static store's ring holds in place of their
    codes: ``ring_from <= at < ring_to``."""
    return (at >= ring_from) & (at < ring_to)


@custom_op("lorc::vector_latents", mutates_args=())
def vector_latents(payload: list[Tensor], values: list[Tensor], window: Tensor, coded: int,
                   tokens: int, sink: Tensor | None, sink_at: Tensor | None,
                   means: Tensor | None, chunk: int, ring_from: Tensor | None = None,
                   ring_to: Tensor | None = None) -> Tensor:
    """Every token's latent ``(b, 1, tokens, r)`` in the window's dtype: the first ``coded``
    slots of the codes decoded, each plus its drift offset where there is a drift table
    ``means (b, rows, r)`` of ``chunk`` positions a row, then the window's ``(b, 1, rows, r)``
    first rows; where ``ring_to`` is given (0-d tensors; every token coded), the window is a
    ring: positions ``ring_from`` to ``ring_to`` are read from its rows (position ``p`` at
    row ``p % rows``) instead. Each row's ``sink (b, 1, 1, r)`` over its position ``sink_at
    (b,)`` (0 where None)."""
    decoded = vector_decode(payload, values)
    if means is not None:
        decoded = decoded + drift.spread(drift.offsets(means), decoded.shape[1], chunk).to(
            decoded.dtype)
    decoded = decoded[:, None].to(window.dtype)
    both = torch.cat([decoded, window], dim=-2)
    # a gather, so no tensor has the coded tokens' length alone (0 until a block fills)
    at = token_positions(torch.arange(tokens, device=window.device), coded, decoded.shape[-2],
                         window.shape[2], ring_from, ring_to)
    latents = both.index_select(2, at)
    if sink is None:
        return latents
    b, r = window.shape[0], window.shape[-1]
    at = (window.new_zeros(b, dtype=torch.long) if sink_at is None else sink_at.long())
    return latents.scatter(2, at.view(b, 1, 1, 1).expand(b, 1, 1, r), sink.to(latents.dtype))


@vector_latents.register_fake
def _(payload, values, window, coded, tokens, sink, sink_at, means, chunk, ring_from=None,
      ring_to=None):
    return window.new_empty(window.shape[0], 1, tokens, window.shape[-1])


VECTOR_LATENTS = torch.ops.lorc.vector_latents.default


@custom_op("lorc::vector_rewritten", mutates_args=())
def vector_rewritten(payload: list[Tensor], z: Tensor, scaled: list[Tensor], norms: list[Tensor],
                     start: Tensor) -> list[Tensor]:
    """The blocks ``(b, S, ceil(t / BLOCK) + 1, index bytes)`` of a static store's ``payload``
    ``(b, S, blocks, index bytes)`` from the one token ``start`` falls in, with the indices of
    ``z (b, t, r)``'s tokens packed over theirs from ``start`` (a token's index is its own;
    the other tokens of those blocks keep theirs), each its nearest codeword: ``scaled``,
    ``norms`` are each run's ``distance_terms`` of its codewords, kept by the store (forming
    them each call doubled a one-token write's time). The caller copies the blocks back in place
    (``index_copy_`` at :func:`rewritten_blocks`): a mutating op would be functionalized, its
    whole payload cloned every step."""
    t = z.shape[1]
    by_kernel = vector_reductions.rewritten(payload, z, scaled, norms, int(start), _staged(t))
    if by_kernel is not None:
        return by_kernel
    block = rewritten_blocks(start, t)
    at = start % BLOCK + torch.arange(t, device=z.device)
    codewords = [-0.5 * s for s in scaled]  # exact
    fresh = run_indices(z.float(), codewords, nearest_codeword)
    out = []
    for (*_, ib), codes, new in zip(layout_of(codewords), payload, fresh):
        held = unpack_bits(codes.index_select(2, block), ib).flatten(-2).long()
        held = held.index_copy(2, at, new)  # (b, S, staged·BLOCK)
        out.append(pack_bits(held.unflatten(-1, (block.shape[0], BLOCK)), ib).contiguous())
    return out


@vector_rewritten.register_fake
def _(payload, z, scaled, norms, start):
    staged = _staged(z.shape[1])
    return [p.new_empty(p.shape[0], p.shape[1], staged, p.shape[3]) for p in payload]


def _staged(t: int) -> int:
    """Blocks a write of ``t`` tokens reaches from any offset in its first block."""
    return (t + BLOCK - 1) // BLOCK + 1


def rewritten_blocks(start: Tensor, t: int) -> Tensor:
    """The blocks a write of ``t`` tokens from token ``start`` reaches, from any offset."""
    return start // BLOCK + torch.arange(_staged(t), device=start.device)
