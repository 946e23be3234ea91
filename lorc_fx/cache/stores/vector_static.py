"""The static store of a latent side stored as product vector codes: the static counterpart
of ``stores.vector.VectorStore``, for ``generate`` with ``cache_implementation="static"`` and
``latent_cache(model, max_cache_len)``.

Every buffer is allocated once and written in place at positions computed from the tensor
``cumulative_length``, so ``write`` holds no branch on data and a compiled decode step traces
once for every position:

- **codes**: per run, ``(b, S, blocks, index bytes)`` uint8 with ``blocks = ceil(max_cache_len
  / BLOCK) + 1`` (one spare: a write stages one block past the last it reaches);
- a **sink** ``(b, 1, 1, r)``: each row's first token's latent as it came (``place_sinks``),
  written by whichever write covers its position, read instead of its code;
- a **ring** of the latest tokens as they came (the layer's ``keys`` / ``values``,
  ``VectorBook.exact_rows(max_cache_len)`` rows, token ``p`` at row ``p % rows``): the
  tokens the dynamic store keeps in its window (``VectorBook.coded``: the recent window and
  the partial block) are read from it, so both stores read every token alike;
- where the book says (``VectorBook.drift_chunk``), the **drift table** ``(b, rows, r)`` of
  every chunk of the code slots, measured by the prefill's write (``stores.drift``): each
  token coded about its chunk's drift from the first chunk.

A token's index depends on that token alone, so every token is coded as it is written: a
write of ``t`` tokens reads the ``ceil(t / BLOCK) + 1`` blocks from the one ``start`` falls
in, unpacks their indices, writes the new tokens' over them and packs them back, and writes
the last of them into the ring. The tokens written so far, ``held`` (a 0-d tensor each write
sets in place), say which positions the ring holds.

What attention reads is all ``max_cache_len`` positions decoded (each plus its drift offset),
the positions from ``VectorBook.coded(held)`` to ``held`` read from the ring instead and each
row's sink written over its position (positions past the cache's length are masked).
Bytes: the codes of ``max_cache_len`` tokens in whole blocks, the spare block, the ring, the
sink and the drift table.
"""
from __future__ import annotations

import torch

from lorc_fx.codes.vector import BLOCK, VectorBook
from lorc_fx.kernels.nearest_codeword import distance_terms

from . import drift
from .full import buffer
from .vector_ops import rewritten_blocks, vector_latents, vector_rewritten


class VectorStaticStore:
    """A side stored as vector codes over all ``max_cache_len`` tokens, and each row's sink
    (the module docstring)."""

    def __init__(self, book: VectorBook):
        self.book = book
        self.payload: tuple[torch.Tensor, ...] = ()  # per run (b, S, blocks, index bytes)
        self.sink: torch.Tensor | None = None
        self.sink_at: torch.Tensor | None = None  # (b,); None: position 0
        self.max_cache_len = 0
        self.means: torch.Tensor | None = None  # (b, rows, r) drift offsets' chunk means
        self.held: torch.Tensor | None = None  # 0-d: the tokens written so far
        # each run's -2c and |c|² (``distance_terms``), formed once for the writes
        self.terms: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def place_sinks(self, positions: torch.Tensor) -> None:
        """Each row's sink at ``positions`` ``(b,)`` instead of position 0; before the first
        write. Beams reorder rows within one prompt's beams, which share it."""
        self.sink_at = positions.long()

    def allocate(self, states: torch.Tensor, basis: torch.Tensor | None,
                 max_cache_len: int, ring: bool = False) -> torch.Tensor:
        """Zeroed codes, sink and ring for ``max_cache_len`` tokens; returns the window: the
        ring."""
        if ring or basis is None:
            raise ValueError("vector codes are stored for latents of full-attention layers only")
        self.max_cache_len, self.book = max_cache_len, self.book.to(states.device)
        scaled, norms = zip(*(distance_terms(c) for c in self.book.codewords))
        self.terms = (list(scaled), list(norms))
        window = buffer(states, basis, self.book.exact_rows(max_cache_len))
        self.held = torch.zeros((), dtype=torch.long, device=states.device)
        if not torch.compiler.is_compiling():  # as the layer's buffers (not in ``tensors``:
            torch._dynamo.mark_static_address(self.held)  # no batch axis, no cache bytes)
        b = window.shape[0]
        blocks = -(-max_cache_len // BLOCK) + 1
        self.payload = tuple(states.new_zeros(b, subs, blocks, ib, dtype=torch.uint8)
                             for _, subs, _, ib in self.book.spec.layout())
        self.sink = buffer(states, basis, 1)
        self.sink_at = (states.new_zeros(b, dtype=torch.long) if self.sink_at is None
                        else self.sink_at.to(states.device))
        chunk = self.book.drift_chunk
        if chunk:
            slots = blocks * BLOCK  # every chunk a slot is in: attention reads them by chunk
            self.means = self.sink.new_zeros(b, -(-slots // chunk), self.sink.shape[-1])
        return window

    def write(self, window: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
              start: torch.Tensor) -> None:
        """Write latents ``states (b, 1, t, r)`` at ``positions`` (from token ``start``, a 0-d
        tensor), in place."""
        b, _, t, r = states.shape
        block = rewritten_blocks(start, t)
        coding, chunk = states[:, 0], self.book.drift_chunk
        if chunk:  # each token about its chunk's drift, measured first where this is a prefill
            if drift.may_measure(t, chunk):
                self.means.copy_(drift.measured(self.means, coding, start, self.sink_at, chunk))
            coding = coding - drift.offsets_at(self.means, start, t, chunk).to(coding.dtype)
        for codes, new in zip(self.payload, vector_rewritten(
                list(self.payload), coding, *self.terms, start)):
            codes.index_copy_(2, block, new)
        last = min(t, window.shape[2])  # the tokens the ring keeps, each at a row of its own
        window.index_copy_(2, positions[t - last:] % window.shape[2], states[:, :, t - last:])
        self.held.copy_(start + t)
        # the sink, where this write covers it (a where, not a branch)
        local = (self.sink_at - start).clamp(0, t - 1).view(b, 1, 1, 1).expand(b, 1, 1, r)
        covered = ((self.sink_at >= start) & (self.sink_at < start + t)).view(b, 1, 1, 1)
        self.sink.copy_(torch.where(covered, states.gather(2, local), self.sink))

    def read(self, window: torch.Tensor) -> torch.Tensor:
        """Every allocated position ``(b, 1, max_cache_len, r)``: decoded (plus its drift
        offset), but those from ``book.coded(held)`` on as the ring holds them and each row's
        sink as it came."""
        return vector_latents([p.flatten(-2) for p in self.payload], self.book.reconstructions,
                              window, self.max_cache_len, self.max_cache_len, self.sink,
                              self.sink_at, self.means, self.book.drift_chunk,
                              self.book.coded(self.held), self.held)

    def tensors(self) -> list[torch.Tensor]:
        """Packed codes, the sink and the drift table (the window, the ring, is the
        layer's)."""
        return ([*self.payload] + ([] if self.sink is None else [self.sink])
                + ([] if self.means is None else [self.means]))
