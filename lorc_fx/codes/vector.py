"""Product vector codes: a latent side coded against codebooks fitted once per model.

Why (issue #13's low budgets): below about three bits per cached value, per-group integer
codes spend half a bit of every kept value on 16-bit scales and zero points, and a scalar
code can spend neither a fraction of a bit nor what channels' values share. Coding each token's latent
against codebooks fitted on calibration latents (the tables belong to the model, like its
weights; no per-token metadata) is what the bit water-filling exploration measured closest
to the rate-distortion bound (bench/results/bit_waterfill-cpu.md, docs/findings.md,
docs/schemes/vector.md "Why vector codes").

Layout (:class:`VectorSpec`): the side's ``r`` channels in runs, each ``(channels, bits)``
with ``bits`` per channel per token a multiple of 1/2, in channel order. A run is cut into
sub-vectors of ``d = sub_dims(bits)`` consecutive channels; each sub-vector ``s`` has its own
table of ``2^(d·bits)`` codewords, and a token stores the index of its nearest codeword:
``d·bits`` bits a sub-vector, so a run costs exactly ``channels·bits`` bits a token. Indices
are packed block by block along the token axis, each block of 8 tokens on its own by
:func:`integer.pack_bits` (8 indices in ``d·bits`` bytes), so codes come in blocks of 8
tokens that concatenate and cut as blocks (a cache appends them a block at a time: packed
over the whole axis, 2- and 4-bit indices would interleave runs that span every block); a
partial last block is padded with the last token and its bytes counted.

A :class:`VectorBook` holds, per run, the encoder's codewords and the decoder's
reconstructions (``(S, K, d)`` each): the reconstructions are the codewords, or the codewords
scaled about each channel's mean so that reconstructions keep the channel's variance
(centroids shrink it; measured better on held-out text, same file).

This module imports nothing from lorc_fx but ``integer``'s packing.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from .integer import pack_bits, unpack_bits

INDEX_BITS = 8  # at most 2^8 codewords a sub-vector: an index fits a byte
VECTOR_WIDTHS = (0.5, 1, 1.5, 2, 2.5, 3)  # widths coded in sub-vectors of more than one channel
BLOCK = 8  # tokens whose indices pack together (8 indices of any width fill whole bytes)
COARSE_PER_CODEWORD = 4  # samples a codeword at least in k-means' coarse steps (``kmeans``)


def sub_dims(bits: float, most: int = 8) -> int:
    """Channels per sub-vector at ``bits`` bits a channel: the most of 16, 8, 4, 2 (at most
    ``most``) whose index ``d·bits`` is a whole number of at most ``INDEX_BITS`` bits; 1 for
    widths past ``VECTOR_WIDTHS`` (whole bits only), whose codebooks are scalar."""
    if bits in VECTOR_WIDTHS:
        for d in (16, 8, 4, 2):
            if d <= most and d * bits <= INDEX_BITS and float(d * bits).is_integer():
                return d
    if not float(bits).is_integer() or not 1 <= bits <= INDEX_BITS:
        raise ValueError(f"bits per channel must be one of {VECTOR_WIDTHS} or a whole number "
                         f"up to {INDEX_BITS}, not {bits}")
    return 1


@dataclass(frozen=True)
class VectorSpec:
    """Runs of ``(channels, bits)`` covering a side's channels in order; every run a whole
    number of sub-vectors. ``tuple_dims`` caps the sub-vector length (the allocation's
    unit: channels given one width together)."""
    runs: tuple[tuple[int, float], ...]
    tuple_dims: int = 8

    def __post_init__(self):
        if not self.runs:
            raise ValueError("a vector spec needs at least one run")
        for channels, bits in self.runs:
            d = sub_dims(bits, self.tuple_dims)
            if channels < 1 or channels % d:
                raise ValueError(f"a run of {channels} channels at {bits} bits is not a whole "
                                 f"number of {d}-channel sub-vectors")

    @property
    def width(self) -> int:
        return sum(c for c, _ in self.runs)

    def layout(self) -> list[tuple[int, int, int, int]]:
        """``(first channel, sub-vectors, channels each, index bits)`` of every run."""
        out, at = [], 0
        for channels, bits in self.runs:
            d = sub_dims(bits, self.tuple_dims)
            out.append((at, channels // d, d, int(d * bits)))
            at += channels
        return out

    def bits_per_token(self) -> float:
        return sum(c * b for c, b in self.runs)

    def nbytes(self, batch: int, tokens: int) -> int:
        """Exact bytes :func:`encode` stores for ``tokens`` tokens of ``batch`` rows."""
        blocks = -(-tokens // BLOCK)
        return batch * blocks * sum(s * ib for _, s, _, ib in self.layout())


@dataclass(frozen=True)
class VectorBook:
    """Per run of a :class:`VectorSpec`: ``(codewords, reconstructions)``, each ``(S, K, d)``;
    ``drift_chunk``: the cache positions a drift offset covers where a cache codes each chunk
    about its drift from the first (``cache.stores.drift``), 0 where it does not;
    ``recent_divisor``: a cache keeps the most recent ``ceil(n / recent_divisor)`` of its
    ``n`` tokens in full precision (0: none), and the partial block (:meth:`coded`)."""
    spec: VectorSpec
    tables: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    drift_chunk: int = 0
    recent_divisor: int = 0

    def __post_init__(self):
        for (_, subs, d, ib), (codewords, values) in zip(self.spec.layout(), self.tables, strict=True):
            if codewords.shape != (subs, 1 << ib, d) or values.shape != codewords.shape:
                raise ValueError(f"a run of {subs} {d}-channel sub-vectors with {ib}-bit indices "
                                 f"takes tables of {(subs, 1 << ib, d)}, not "
                                 f"{tuple(codewords.shape)} and {tuple(values.shape)}")

    @property
    def codewords(self) -> list[torch.Tensor]:
        """Each run's encoder table ``(S, K, d)``."""
        return [c for c, _ in self.tables]

    @property
    def reconstructions(self) -> list[torch.Tensor]:
        """Each run's decoder table ``(S, K, d)``."""
        return [v for _, v in self.tables]

    @property
    def nbytes(self) -> int:
        """Bytes of the tables (the model's, like its weights; not the cache's)."""
        return sum(c.nbytes + v.nbytes for c, v in self.tables)

    def to(self, device: torch.device | str) -> "VectorBook":
        return replace(self, tables=tuple((c.to(device), v.to(device)) for c, v in self.tables))

    def coded(self, tokens):
        """How many of a cache's first ``tokens`` tokens it holds as codes (an int, a
        symbolic int or a tensor): whole blocks, the recent window and the partial block after
        them kept in full precision. Never decreases as ``tokens`` grows, by one block at
        most a token."""
        return (tokens - self._recent(tokens)) // BLOCK * BLOCK

    def exact_rows(self, tokens: int) -> int:
        """The most tokens a cache of up to ``tokens`` tokens keeps in full precision: the
        recent window's and a partial block's."""
        return self._recent(tokens) + BLOCK - 1

    def _recent(self, tokens):
        """The recent window of a cache of ``tokens`` tokens: ``ceil(tokens /
        recent_divisor)``, 0 without one."""
        return -(-tokens // self.recent_divisor) if self.recent_divisor else 0


@dataclass(frozen=True)
class VectorCodes:
    """Packed indices per run, each ``(batch, S, blocks·index bits)`` uint8, standing for
    ``tokens`` tokens."""
    spec: VectorSpec
    payload: tuple[torch.Tensor, ...]
    tokens: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payload)


def _sub_vectors(z: torch.Tensor, first: int, subs: int, d: int) -> torch.Tensor:
    """``z (b, n, r)``'s channels ``first .. first + subs·d`` as ``(b, subs, n, d)``."""
    b, n, _ = z.shape
    return z[..., first:first + subs * d].reshape(b, n, subs, d).transpose(1, 2)


def nearest(x: torch.Tensor, codewords: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Index of the nearest of ``codewords (S, K, d)`` to each of ``x (..., S, n, d)``:
    ``(..., S, n)`` int64, ``chunk`` tokens at a time (one channel a sub-vector: by bisection
    between the sorted codewords' midpoints)."""
    lead, (subs, n, d) = x.shape[:-3], x.shape[-3:]
    flat = x.reshape(-1, subs, n, d).transpose(0, 1).reshape(subs, -1, d).float()
    books = codewords.float()
    if d == 1:
        levels, order = books[..., 0].sort(dim=1)
        place = torch.searchsorted((levels[:, 1:] + levels[:, :-1]) / 2, flat[..., 0].contiguous())
        idx = order.gather(1, place)
    else:
        norms = (books ** 2).sum(-1)[:, None, :]
        idx = torch.cat([torch.baddbmm(norms, part, books.transpose(1, 2), alpha=-2).argmin(-1)
                         for part in flat.split(chunk, dim=1)], dim=1)
    return idx.reshape(subs, -1, n).transpose(0, 1).reshape(*lead, subs, n)


# the nearest codewords of (S, samples, d) among (S, K, d): nearest, or a kernel computing the same
Assign = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def encode(z: torch.Tensor, book: VectorBook, assign: Assign = nearest) -> VectorCodes:
    """The codes of a latent ``z (b, n, r)`` (``r`` the spec's width; ``assign`` as
    :func:`indices` takes it)."""
    spec = book.spec
    if z.dim() != 3 or z.shape[-1] != spec.width:
        raise ValueError(f"encode takes a (batch, tokens, {spec.width}) latent, not "
                         f"{tuple(z.shape)}")
    n = z.shape[1]
    pad = -n % BLOCK
    if pad:  # the last token repeated: a whole block, its bytes counted
        z = torch.cat([z, z[:, -1:].expand(-1, pad, -1)], dim=1)
    payload = packed_runs(indices(z, book, assign), book.codewords)
    return VectorCodes(spec, tuple(payload), n)


def indices(z: torch.Tensor, book: VectorBook, assign: Assign = nearest) -> list[torch.Tensor]:
    """Each run's nearest-codeword indices of a latent ``z (b, n, r)``, ``(b, S, n)`` int64:
    a token's indices depend on that token alone (``assign``: the nearest codewords of
    ``(S, samples, d)``, :func:`nearest` or a kernel computing the same)."""
    return run_indices(z, book.codewords, assign)


def layout_of(tables: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """:meth:`VectorSpec.layout` read off a book's per-run tables ``(S, K, d)`` alone (``K``
    is ``2^index bits``): what the ops of ``cache.stores.vector_ops`` take instead of a spec."""
    out, at = [], 0
    for table in tables:
        subs, count, d = table.shape
        out.append((at, subs, d, count.bit_length() - 1))
        at += subs * d
    return out


def run_indices(z: torch.Tensor, codewords: list[torch.Tensor], assign: Assign = nearest
                ) -> list[torch.Tensor]:
    """:func:`indices` against each run's ``codewords (S, K, d)``."""
    out = []
    for (first, subs, d, _), books in zip(layout_of(codewords), codewords):
        x = _sub_vectors(z, first, subs, d)  # (b, S, n, d)
        b, _, n, _ = x.shape
        idx = assign(x.transpose(0, 1).reshape(subs, b * n, d), books)
        out.append(idx.reshape(subs, b, n).transpose(0, 1))
    return out


def packed_runs(idx: list[torch.Tensor], tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each run's indices ``(b, S, blocks·BLOCK)`` packed block by block: ``(b, S, blocks·index
    bytes)`` uint8."""
    return [pack_bits(run.reshape(*run.shape[:-1], -1, BLOCK), ib).flatten(-2)
            for (*_, ib), run in zip(layout_of(tables), idx)]


def unpacked_runs(payload: list[torch.Tensor], tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each run's indices ``(b, S, blocks·BLOCK)`` int64 from its packed ``(b, S, blocks·index
    bytes)``."""
    out = []
    for (*_, ib), packed in zip(layout_of(tables), payload):
        blocks = packed.reshape(*packed.shape[:-1], -1, ib)  # a block's 8 indices in ib bytes
        out.append(unpack_bits(blocks, ib).flatten(-2).long())
    return out


def decode(codes: VectorCodes, book: VectorBook) -> torch.Tensor:
    """The latent ``(b, tokens, r)`` the codes stand for, in the reconstructions' dtype."""
    values = book.reconstructions
    idx = [run[..., :codes.tokens] for run in unpacked_runs(list(codes.payload), values)]
    return rebuilt(idx, values)


def reconstruction(samples: torch.Tensor, book: VectorBook, assign: Assign = nearest
                   ) -> torch.Tensor:
    """Latents ``samples (n, r)`` as their codes decode (``decode(encode(...))`` without the
    packing; ``assign`` as :func:`indices` takes it): ``(n, r)``."""
    return rebuilt(indices(samples.float()[None], book, assign), book.reconstructions)[0]


def rebuilt(idx: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The latent ``(b, n, r)`` of each run's indices ``(b, S, n)``: their reconstructions
    ``values (S, K, d)``, looked up as rows of each run's tables stacked ``(S·K, d)`` (an
    embedding lookup, laid out token-major as the latent is)."""
    parts = []
    for table, run in zip(values, idx):
        subs, count, d = table.shape
        rows = run.transpose(1, 2) + torch.arange(0, subs * count, count, device=run.device)
        parts.append(torch.nn.functional.embedding(rows, table.reshape(subs * count, d))
                     .flatten(-2))  # (b, n, S·d)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------- fitting

def kmeans(x: torch.Tensor, count: int, iters: int = 15, seed: int = 0,
           assign: Assign = nearest) -> torch.Tensor:
    """``count`` codewords for each of the ``S`` sample sets ``x (S, n, d)`` by Lloyd's
    algorithm (``n >= count``), started at the samples' quantiles in one dimension and at
    ``count`` distinct samples drawn with ``seed`` in more; a codeword no sample is nearest to
    stays where it was (``assign``: each sample's nearest codeword, :func:`nearest` or a
    kernel computing the same; in one dimension :func:`_scalar_lloyd` needs none).

    In more dimensions the first two thirds of the ``iters`` steps read a quarter of the
    samples (drawn with ``seed``; at least ``COARSE_PER_CODEWORD`` a codeword), the rest all of
    them: the coarse steps move the codewords most of the way at a quarter of the distances
    computed, which are nearly all of the fit's time. On the default model's calibration
    latents (12 of its 60 sides, 0.5-4 bits a channel) 10 coarse and 5 full steps fitted
    books whose mean relative error per channel was at most 2.1% above 15 full steps' (1.5%
    at 0.5 bits, none at 4), in 0.73 of the time. ``(S, count, d)``."""
    subs, n, d = x.shape
    if n < count:
        raise ValueError(f"{count} codewords need at least as many samples, not {n}")
    if d == 1:
        return _scalar_lloyd(x[..., 0], count, iters)[..., None]
    draw = torch.Generator().manual_seed(seed)
    start = torch.randperm(n, generator=draw)[:count]
    books = x[:, start].clone()
    coarse = n // 4 >= COARSE_PER_CODEWORD * count
    fine = iters - 2 * iters // 3 if coarse else iters
    if coarse:
        part = x[:, torch.randperm(n, generator=draw)[:n // 4]].contiguous()
        books = _lloyd_steps(part, books, iters - fine, assign)
    return _lloyd_steps(x, books, fine, assign)


def _lloyd_steps(x: torch.Tensor, books: torch.Tensor, steps: int, assign: Assign
                 ) -> torch.Tensor:
    """``books (S, K, d)`` after ``steps`` of Lloyd's algorithm on ``x (S, n, d)``: each
    codeword moved to the mean of the samples nearest to it, where there are any."""
    subs, n, d = x.shape
    for _ in range(steps):
        idx = assign(x, books)
        sums = torch.zeros_like(books).scatter_add_(1, idx[..., None].expand(-1, -1, d), x)
        counts = torch.zeros(subs, books.shape[1], dtype=x.dtype).scatter_add_(
            1, idx, torch.ones(subs, n, dtype=x.dtype))
        books = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], books)
    return books


def _scalar_lloyd(x: torch.Tensor, count: int, iters: int) -> torch.Tensor:
    """``count`` levels for each row of samples ``x (S, n)`` by Lloyd's algorithm, started at
    the samples' quantiles (drawn samples may fall together where a channel is dense;
    quantiles spread). A level's samples lie between the midpoints to its neighbours (a
    sample on a midpoint with the lower level, as :func:`nearest` assigns it), so with the
    samples sorted once a step finds the midpoints' places and each level's sum from prefix
    sums, instead of a distance per sample and level. The levels stay sorted: each new one is
    a mean of samples between its old midpoints, or the old level where there are none."""
    xs = _sorted_rows(x)
    at = (torch.arange(count, dtype=torch.float64) + 0.5) / count * (x.shape[1] - 1)
    below = at.long()  # torch.quantile's linear interpolation between order statistics
    above = (below + 1).clamp_max(x.shape[1] - 1)
    levels = xs[:, below] + (at - below).to(x.dtype) * (xs[:, above] - xs[:, below])
    prefix = torch.nn.functional.pad(xs.double().cumsum(1), (1, 0))  # (S, n + 1)
    first = torch.zeros(x.shape[0], 1, dtype=torch.long)
    last = torch.full_like(first, x.shape[1])
    for _ in range(iters):
        mids = ((levels[:, 1:] + levels[:, :-1]) / 2).contiguous()
        bounds = torch.cat([first, torch.searchsorted(xs, mids, right=True), last], dim=1)
        counts = bounds.diff(dim=1)
        sums = prefix.gather(1, bounds[:, 1:]) - prefix.gather(1, bounds[:, :-1])
        levels = torch.where(counts > 0, (sums / counts.clamp_min(1)).to(levels.dtype), levels)
    return levels


def _sorted_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x (S, n)`` sorted, contiguous: by numpy's sort on the CPU (SIMD, one
    thread: 0.023 s against torch's 0.051 s at two threads for 192 rows of 8160 samples,
    most of a scalar book's fit)."""
    if x.device.type != "cpu":
        return x.sort(dim=1).values.contiguous()
    return torch.from_numpy(np.sort(x.numpy(), axis=1))


# Tail levels of the scalar tables (``fit(tails=True)``), by table size: how far past the
# outermost fitted level each lies, in the calibration samples' range. Lloyd puts every level
# inside that range, so a value past it codes as the outermost level; the keys of a long,
# repetitive context drift there (one channel of the default model's layer 19: 78% of a relay
# prompt's keys at 4096-8180 below its calibration range). With these levels the keys'
# latent error there fell 2.3x for 2% more on the calibration latents
# (bench/results/retrieval_relay_tails-cpu.md).
TAIL_REACH = {16: (0.3,), 32: (0.15, 0.5), 64: (0.1, 0.25, 0.5, 1.0)}


def _scalar_with_tails(x: torch.Tensor, count: int, iters: int) -> torch.Tensor:
    """``count`` levels for each row of ``x (S, n)``: ``count - 2t`` by :func:`_scalar_lloyd`
    and ``t = len(TAIL_REACH[count])`` past each end, at ``TAIL_REACH`` of the row's range
    beyond its outermost fitted level; ``(S, count)``, sorted."""
    reach = torch.tensor(TAIL_REACH[count], dtype=x.dtype)
    inner = _scalar_lloyd(x, count - 2 * len(reach), iters)
    span = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)
    return torch.cat([inner[:, :1] - span * reach.flip(0), inner, inner[:, -1:] + span * reach],
                     dim=1)


def fit(samples: torch.Tensor, spec: VectorSpec, keep_variance: bool = True,
        iters: int = 15, assign: Assign = nearest, tails: bool = False) -> VectorBook:
    """A book for ``spec`` fitted on calibration latents ``samples (n, r)`` (float32):
    k-means per sub-vector (:func:`kmeans`, with ``assign``); with ``keep_variance`` the
    reconstructions scaled about each channel's mean to its variance on ``samples``; with
    ``tails`` the scalar tables of ``TAIL_REACH``'s sizes keep levels past the samples' range
    (:func:`_scalar_with_tails`)."""
    return fit_measured(samples, spec, keep_variance, iters, assign, tails)[0]


def fit_measured(samples: torch.Tensor, spec: VectorSpec, keep_variance: bool = True,
                 iters: int = 15, assign: Assign = nearest, tails: bool = False
                 ) -> tuple[VectorBook, torch.Tensor]:
    """:func:`fit`, and the squared coding error of each channel the book codes, summed over
    ``samples`` (``(channels,)`` float64): the book's :func:`reconstruction` of them less
    themselves, from the fit's own last assignment."""
    x = samples.float()[None]
    tables, errors = [], []
    for first, subs, d, ib in spec.layout():
        sets = _sub_vectors(x, first, subs, d)[0].contiguous()  # (S, n, d)
        count = 1 << ib
        if tails and d == 1 and count in TAIL_REACH:
            codewords = _scalar_with_tails(sets[..., 0], count, iters)[..., None]
        else:
            codewords = kmeans(sets, count, iters, assign=assign)
        idx = assign(sets, codewords)[..., None].expand(-1, -1, d)
        values = codewords
        if keep_variance:
            rec = codewords.gather(1, idx)
            mean = sets.mean(1, keepdim=True)
            spread = ((sets - mean) ** 2).sum(1, keepdim=True) / (
                (rec - mean) ** 2).sum(1, keepdim=True).clamp_min(1e-30)
            values = mean + (codewords - mean) * spread.sqrt()
        tables.append((codewords, values))
        errors.append(((values.gather(1, idx) - sets).double() ** 2).sum(1).flatten())
    return VectorBook(spec, tuple(tables)), torch.cat(errors)


def select(books: dict[float, VectorBook], bits: list[float],
           tuple_dims: int = 8) -> tuple[VectorBook, torch.Tensor]:
    """The book of an allocation ``bits`` (one width per channel, 0: dropped) cut from
    ``books``, one per width fitted on every channel (``VectorSpec(((r, width),))``), and the
    indices of the channels it keeps: runs of equal widths in channel order."""
    kept = [c for c, b in enumerate(bits) if b]
    if not kept:
        raise ValueError("an allocation that keeps no channel has no book")
    runs: list[list] = []  # [first channel, channels, bits], over the kept channels in order
    for c in kept:
        if runs and runs[-1][2] == bits[c] and runs[-1][0] + runs[-1][1] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1, bits[c]])
    spec = VectorSpec(tuple((n, b) for _, n, b in runs), tuple_dims)
    tables = []
    for first, channels, b in runs:
        d = sub_dims(b, tuple_dims)
        if first % d:
            raise ValueError(f"a run at {b} bits starting at channel {first} does not start a "
                             f"{d}-channel sub-vector")
        codewords, values = books[b].tables[0]
        cut = slice(first // d, (first + channels) // d)
        tables.append((codewords[cut], values[cut]))
    return VectorBook(spec, tuple(tables)), torch.tensor(kept)
