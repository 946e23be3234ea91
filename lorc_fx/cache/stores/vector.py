"""The dynamic store of a latent side stored as product vector codes
(:class:`~lorc_fx.codes.vector.VectorBook`, the ``vector`` scheme's plans). It holds

- **codes**: the indices of whole blocks of ``BLOCK`` (8) tokens, packed per run (``(b, S,
  blocks·index bits)`` uint8 each), the blocks aligned at cache position 0, followed by
  ``SPARE_BLOCKS`` spare blocks of slots;
- a **window**: the tokens after the coded blocks, in the latents' dtype, then
  ``SPARE_ROWS`` spare rows (``keys`` / ``values`` hold it): the most recent
  ``ceil(n / recent_divisor)`` of the ``n`` tokens and the partial block after the whole
  blocks before them (``VectorBook.coded``); a block is coded once it leaves them;
- a **sink**: each row's first token's latent in the latents' dtype, read instead of its code
  (position 0, or where ``place_sinks`` says: ``generate`` places each row's after its left
  padding, from the attention mask).
  The first token draws attention out of all proportion to its content (the attention sink);
  coded, its error costs more than every other token's (measured: ×2.46 perplexity on news at
  2.56 bits without it, ×1.043 with it; docs/findings.md). Its code is stored too, so blocks
  stay aligned at position 0;
- where the book says (``VectorBook.drift_chunk``), **drift offsets**: each chunk's mean
  latent ``(b, rows, r)``, measured at the prefill; tokens are coded about their chunk's
  drift from the first chunk (``stores.drift``).

What attention reads is the decoded codes (plus their drift offsets), then the window, with
each row's sink written over its position, rebuilt through the bases: one op,
``lorc::vector_latents``, which a compiled decode step replaces by attention that reads the
codes themselves (``compile.quantized_attention``: scores and value sums by codebook table).

Traced by dynamo (``lorc_backend``), ``append`` and ``read`` follow ``stores.integer``'s rules:
no branch on how many blocks fill, and no tensor whose length could be 0 or 1 once decoding
runs (hence the spare blocks and rows). A step writes the incoming tokens over the window's
spare rows, codes the window's first block(s) (padded to whole blocks; each token's index
depends on that token alone) and splices them over the spare block slots, keeping them, and
dropping them from the window, only when a block left the recent tokens. The coded token
count is read off the codes' shape, never kept as a number (dynamo would guard on it).

A forward outside ``generate`` over a left-padded batch keeps position 0 of every row (a pad
token in a padded row): the store never reads the attention mask itself.

``cut`` keeps the whole blocks before the cut as they are and moves the kept tokens of the
cut block back into the window, decoded (they are coded again, from their reconstructions,
when the block leaves the recent tokens); the blocks kept stay coded though the recent window
of fewer tokens would hold some, until the window grows past them. Beam reordering and batch
repeat/select index codes, sinks and windows along batch. A ``StaticCache`` of a vector plan
holds
:class:`~lorc_fx.cache.stores.vector_static.VectorStaticStore` sides instead.
"""
from __future__ import annotations

import torch

from lorc_fx.codes.integer import splice
from lorc_fx.codes.vector import BLOCK, VectorBook, VectorCodes, decode

from . import drift
from .integer import SPARE_ROWS, with_spare_rows
from .vector_ops import vector_encode, vector_latents

SPARE_BLOCKS = 2  # blocks of code slots a side keeps past its coded tokens


class VectorStore:
    """One side's codes and sink (its window is the layer's ``keys`` or ``values``)."""

    def __init__(self, book: VectorBook):
        self.book = book
        self.payload: tuple[torch.Tensor, ...] | None = None  # per run, spare blocks included
        self.sink: torch.Tensor | None = None  # (b, 1, 1, r): each row's first token as it came
        self.sink_at: torch.Tensor | None = None  # (b,) its position; None: position 0
        self.started = False
        self.means: torch.Tensor | None = None  # (b, rows, r) drift offsets' chunk means

    def _index_bytes(self) -> list[int]:
        """Bytes a block of each run's indices takes."""
        return [ib for *_, ib in self.book.spec.layout()]

    @property
    def coded(self) -> int:
        """Tokens held as codes (whole blocks), read off the payload's shape."""
        if self.payload is None:
            return 0
        return (self.payload[0].shape[-1] // self._index_bytes()[0] - SPARE_BLOCKS) * BLOCK

    @property
    def codes(self) -> VectorCodes | None:
        """The codes of the coded tokens, without spare slots; None while there are none."""
        coded = self.coded
        if coded == 0:
            return None
        return VectorCodes(self.book.spec, tuple(
            p.narrow(-1, 0, coded // BLOCK * ib) for p, ib in zip(self.payload, self._index_bytes())),
            coded)

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

    def window_tokens(self, window: torch.Tensor) -> torch.Tensor:
        """The tokens of the window, without spare rows."""
        return window if self.payload is None else window.narrow(2, 0, window.shape[-2] - SPARE_ROWS)

    def tokens(self, window: torch.Tensor) -> int:
        if self.payload is None:
            return window.shape[-2] if window.dim() == 4 else 0
        return self.coded + window.shape[-2] - SPARE_ROWS

    def append(self, window: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``new`` latents ``(b, 1, n, r)`` after the side's, the whole blocks its window then
        starts with coded. Returns the window."""
        if self.payload is None:  # the first tokens: spare slots only
            self.book = self.book.to(new.device)
            self.payload = tuple(new.new_zeros(new.shape[0], subs, SPARE_BLOCKS * ib,
                                               dtype=torch.uint8)
                                 for _, subs, _, ib in self.book.spec.layout())
            window = with_spare_rows(new[:, :, :0])
        if not self.started:  # each row's sink among the first tokens
            self.started = True
            self.sink = new.gather(2, self._sink_index(new).clamp_max(new.shape[2] - 1)).clone()
        held, incoming = window.shape[-2] - SPARE_ROWS, new.shape[-2]
        tokens, coded = held + incoming, self.coded
        chunk = self.book.drift_chunk
        if chunk:
            self._measure(new[:, 0], coded + held, chunk)
        # as IntegerStore.append: the new tokens over the spare rows, and one row more
        grown = torch.cat([window, new.new_zeros(*new.shape[:-2], incoming + 1, new.shape[-1])],
                          dim=-2).slice_scatter(new, dim=2, start=held, end=tokens)
        # the window's tokens that leave the recent ones, whole blocks (none after a cut)
        whole = torch.sym_max(self.book.coded(coded + tokens) - coded, 0)
        if not torch.compiler.is_compiling() and whole == 0:  # eager: no block left
            return grown.narrow(2, 0, tokens + SPARE_ROWS)
        # code as many blocks as can have left and one more (a static shape; rows past the
        # tokens are padding), keep `whole` tokens of them and the spare slots
        rows = (BLOCK - 1 + incoming) // BLOCK * BLOCK + BLOCK
        staged = torch.cat([grown, grown.new_zeros(*new.shape[:-2], rows, new.shape[-1])],
                           dim=-2).narrow(2, 0, rows)
        coding = staged[:, 0]
        if chunk:  # each token about its chunk's drift
            offsets = drift.offsets_at(self.means, coded, rows, chunk)
            coding = coding - offsets.to(coding.dtype)
        fresh = vector_encode(coding, self.book.codewords)
        blocks = coded // BLOCK
        self.payload = tuple(splice(old, new_codes, -1, blocks * ib,
                                    (blocks + whole // BLOCK + SPARE_BLOCKS) * ib)
                             for old, new_codes, ib in zip(self.payload, fresh,
                                                           self._index_bytes()))
        return grown.narrow(2, whole, tokens + SPARE_ROWS - whole).clone()

    def _measure(self, new: torch.Tensor, start, chunk: int) -> None:
        """The drift table grown to the tokens after ``new (b, n, r)`` (written from position
        ``start``), and measured where this write is a prefill (``drift.measured``)."""
        rows, traced = drift.rows_for(start + new.shape[1], chunk), torch.compiler.is_compiling()
        if self.means is None:
            self.means = new.new_zeros(new.shape[0], rows, new.shape[-1])
        elif traced or rows != self.means.shape[1]:  # eager: only where a chunk begins
            self.means = drift.grown(self.means, rows)
        if drift.may_measure(new.shape[1], chunk) and (traced or start == 0):
            self.means = drift.measured(self.means, new, start, self.sink_at, chunk)

    def read(self, window: torch.Tensor) -> torch.Tensor:
        """Every token's latent ``(b, 1, n, r)``: decoded codes (each plus its chunk's drift
        offset), then the window's tokens; each row's sink as it came."""
        if self.payload is None:
            tokens = window
            if self.sink is None:
                return tokens
            return tokens.scatter(2, self._sink_index(tokens), self.sink.to(tokens.dtype))
        return vector_latents(list(self.payload), self.book.reconstructions, window, self.coded,
                              self.tokens(window), self.sink, self.sink_at, self.means,
                              self.book.drift_chunk)

    def cut(self, window: torch.Tensor, keep: int) -> torch.Tensor:
        """Keep the first ``keep`` tokens (fewer than held): whole blocks stay coded, the rest
        of the cut block returns to the window, decoded; a sink cut away is dropped (every
        row's, where one row's is). Returns the window."""
        coded = self.coded
        if self.sink is not None and (keep == 0 or (self.sink_at is not None
                                                    and int(self.sink_at.max()) >= keep)):
            self.sink = None
        self.started = keep > 0
        chunk = self.book.drift_chunk
        if self.means is not None:  # the rows of the tokens kept (none: measured afresh)
            self.means = self.means[:, :drift.rows_for(keep, chunk)] if keep else None
        if self.payload is None:
            return window[:, :, :keep]
        if keep >= coded:
            return with_spare_rows(window[:, :, :keep - coded])
        blocks = keep // BLOCK
        tail = decode(self.codes, self.book)[:, None, blocks * BLOCK:keep].to(window.dtype)
        if chunk:
            start = blocks * BLOCK
            offsets = drift.offsets_at(self.means, start, keep - start, chunk)
            tail = tail + offsets[:, None].to(tail.dtype)
        self.payload = tuple(p[..., :(blocks + SPARE_BLOCKS) * ib].clone()
                             for p, ib in zip(self.payload, self._index_bytes()))
        return with_spare_rows(tail)

    def map_batch(self, fn) -> None:
        for name in ("sink", "sink_at", "means"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.payload is not None:
            self.payload = tuple(fn(p) for p in self.payload)

    def token_axes(self, window: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """The window's and the codes' tensors, each with its axis that grows with tokens."""
        if self.payload is None:
            return []
        return ([(window, 2)] + [(p, 2) for p in self.payload]
                + ([] if self.means is None else [(self.means, 1)]))

    def tensors(self, window: torch.Tensor) -> list[torch.Tensor]:
        """The window's tokens, the sink, the packed indices of the coded tokens and the drift
        table's rows of the chunks the tokens reach (the book is the model's, like its
        weights: ``VectorBook.nbytes``)."""
        out = [self.window_tokens(window)] + ([] if self.sink is None else [self.sink])
        if self.means is not None:
            chunks = drift.rows_for(self.tokens(window), self.book.drift_chunk) - 1
            out.append(self.means[:, :chunks])
        codes = self.codes
        return out + ([] if codes is None else list(codes.payload))
