"""The dynamic store of a latent side stored as product vector codes
(:class:`~lorc_fx.codes.vector.VectorBook`, the ``vector`` scheme's plans). It holds

- **codes**: the indices of whole blocks of ``BLOCK`` (8) tokens, packed per run
  (``VectorCodes``: ``(b, S, blocks·index bits)`` uint8 each), the blocks aligned at cache
  position 0;
- a **window**: the tokens after the last whole block (fewer than ``BLOCK``), in the
  latents' dtype, coded once their block fills (``keys`` / ``values`` hold it);
- a **sink**: each row's first token's latent in the latents' dtype, read instead of its code
  (position 0, or where ``place_sinks`` says: ``generate`` places each row's after its left
  padding, from the attention mask).
  The first token draws attention out of all proportion to its content (the attention sink);
  coded, its error costs more than every other token's (measured: ×2.46 perplexity on news at
  2.56 bits without it, ×1.043 with it; bench/results/bit_waterfill-cpu.md). Its code is
  stored too, so blocks stay aligned at position 0.

What attention reads is ``cat([decode(codes), window])`` with each row's sink written over its
position, rebuilt through the bases.

A forward outside ``generate`` over a left-padded batch keeps position 0 of every row (a pad
token in a padded row): the store never reads the attention mask itself.

``crop`` keeps the whole blocks before the cut as they are and moves the kept tokens of the
cut block back into the window, decoded (they are coded again, from their reconstructions,
when the block fills). Beam reordering and batch repeat/select index codes, sinks and windows
along batch. Coding and decoding run eagerly: under ``torch.compile`` they are left out of the
graph (``torch.compiler.disable``), so a compiled model gives the eager tokens but no speed-up.
There is no static store of vector codes: a ``StaticCache`` of a vector plan is refused where
the cache is built (``stores.static_store``).
"""
from __future__ import annotations

import torch

from lorc_fx.codes.vector import BLOCK, VectorBook, VectorCodes, decode, encode


class VectorStore:
    """One side's codes and sink (its window is the layer's ``keys`` or ``values``)."""

    def __init__(self, book: VectorBook):
        self.book = book
        self.codes: VectorCodes | None = None  # whole blocks; None before the first block fills
        self.sink: torch.Tensor | None = None  # (b, 1, 1, r): each row's first token as it came
        self.sink_at: torch.Tensor | None = None  # (b,) its position; None: position 0
        self.started = False

    @property
    def coded(self) -> int:
        return 0 if self.codes is None else self.codes.tokens

    def _sink_index(self, like: torch.Tensor) -> torch.Tensor:
        """Where each row's sink sits, as an index into ``like``'s token axis."""
        b, _, _, r = like.shape
        at = like.new_zeros(b, dtype=torch.long) if self.sink_at is None else self.sink_at
        return at.to(like.device).view(b, 1, 1, 1).expand(b, 1, 1, r)

    def place_sinks(self, positions: torch.Tensor) -> None:
        """Each row's sink at ``positions`` ``(b,)`` (its first token after left padding)
        instead of position 0; before the first tokens."""
        if self.started:
            raise ValueError("sinks are placed before the cache holds tokens")
        self.sink_at = positions.long()

    def tokens(self, window: torch.Tensor) -> int:
        return self.coded + (window.shape[-2] if window.dim() == 4 else 0)

    @torch.compiler.disable
    def append(self, window: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``new`` latents ``(b, 1, n, r)`` after ``window``'s, the whole blocks coded; the
        window left (fewer than ``BLOCK`` tokens)."""
        if window.dim() != 4:  # the layer's first update: an empty window
            window = new[:, :, :0]
            self.book = self.book.to(new.device)
        if not self.started:  # the first tokens: each row's sink among them
            self.started = True
            self.sink = new.gather(2, self._sink_index(new).clamp_max(new.shape[2] - 1)).clone()
        window = torch.cat([window, new], dim=-2)
        whole = window.shape[-2] // BLOCK * BLOCK
        if whole:
            self._extend(encode(window[:, 0, :whole].float(), self.book))
        return window[:, :, whole:]

    def _extend(self, fresh: VectorCodes) -> None:
        if self.codes is None:
            self.codes = fresh
            return
        payload = tuple(torch.cat([a, b], dim=-1) for a, b in zip(self.codes.payload, fresh.payload))
        self.codes = VectorCodes(self.codes.spec, payload, self.codes.tokens + fresh.tokens)

    @torch.compiler.disable
    def read(self, window: torch.Tensor) -> torch.Tensor:
        """Every token's latent ``(b, 1, n, r)``: decoded codes, then the window; each row's
        sink as it came."""
        if self.codes is None:
            tokens = window
        else:
            decoded = decode(self.codes, self.book)[:, None].to(window.dtype)
            tokens = torch.cat([decoded, window], dim=-2)
        if self.sink is None:
            return tokens
        return tokens.scatter(2, self._sink_index(tokens), self.sink.to(tokens.dtype))

    def cut(self, window: torch.Tensor, keep: int) -> torch.Tensor:
        """Keep the first ``keep`` tokens (fewer than held): whole blocks stay coded, the rest
        of the cut block returns to the window, decoded; a sink cut away is dropped (every
        row's, where one row's is). Returns the window."""
        coded = self.coded
        if self.sink is not None and (keep == 0 or (self.sink_at is not None
                                                    and int(self.sink_at.max()) >= keep)):
            self.sink = None
        self.started = keep > 0
        if keep >= coded:
            return window[:, :, :keep - coded]
        blocks = keep // BLOCK
        tail = decode(self.codes, self.book)[:, None, blocks * BLOCK:keep].to(window.dtype)
        if blocks == 0:
            self.codes = None
        else:
            self.codes = VectorCodes(self.codes.spec, tuple(
                p[..., :blocks * p.shape[-1] // (coded // BLOCK)].clone()
                for p in self.codes.payload), blocks * BLOCK)
        return tail

    def map_batch(self, fn) -> None:
        for name in ("sink", "sink_at"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.codes is not None:
            self.codes = VectorCodes(self.codes.spec, tuple(fn(p) for p in self.codes.payload),
                                     self.codes.tokens)

    def token_axes(self, window: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        return []  # coded and decoded outside the graph; its window is under a block long

    def tensors(self, window: torch.Tensor) -> list[torch.Tensor]:
        """The window, the sink and the packed indices (the book is the model's, like its
        weights: ``VectorBook.nbytes``)."""
        out = [window] + ([] if self.sink is None else [self.sink])
        return out + ([] if self.codes is None else list(self.codes.payload))
