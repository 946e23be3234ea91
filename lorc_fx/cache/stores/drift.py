"""Drift offsets: a vector-coded side's tokens coded about how far each chunk of the context
has drifted from the first.

Why (issue #38): the books are fitted on short calibration windows, and over a long context a
side's latents drift away from where the first tokens sit (a repetitive haystack the most). At
8k tokens the default plans' codes then clip what keys carry: relay answers fell to 58% and
61% of the full cache's at 2.56 and 1.92 bits. Coding each chunk of ``chunk`` cache positions
about its drift (its mean latent less the first chunk's, measured at the prefill) found them
all again (bench/results/retrieval_relay_offsets-cpu.md, docs/retrieval.md).

A side keeps ``means (b, rows, r)``: row ``k`` the mean latent of chunk ``k`` (positions
``k·chunk .. (k + 1)·chunk``, ``chunk`` the book's ``drift_chunk``, a plan option), measured
by the write that holds it from position 0 (a prefill: a write from position 0 holding at
least ``chunk // 4`` tokens of the first chunk after its row's sink, and as many of the
chunk itself; padding and the sink left out). Rows the prefill does not measure (a chunk it
holds too few tokens of, the chunks decode steps reach) take the last measured row's, so
every token of a chunk, whenever written, is coded about the same offset ``means[k] -
means[0]``: the first chunk's is zero (it is coded as without offsets, bit for bit), and a
side whose first chunk was never measured has none. A token is coded as ``latent - offset``
and read as ``decode(codes) + offset``; the sink is read as it came.

Bytes: a row of ``r`` floats a chunk of the context (``planner.code_bits``: ``r`` stored
floats each ``chunk`` tokens), the first included. A dynamic store keeps one row past the
chunks its tokens reach, so the table's axis is never 1 long (a compiled decode step would
specialise on it); a static one every chunk of its code slots. Either way ``rows·chunk``
covers every code slot (a dynamic store's spare slots are fewer than a chunk of at least
``options.MIN_DRIFT_CHUNK`` positions), which attention over the codes relies on to read the
offsets a chunk at a time (``compile.quantized_attention``).

Every function here is tensor maths with no branch on data, and on lengths only where they are
static (``may_measure``), so the stores' compiled writes trace it once.
"""
from __future__ import annotations

import torch


def least_tokens(chunk: int) -> int:
    """Tokens of a chunk (and of the first chunk) a prefill measures its mean from."""
    return max(chunk // 4, 1)


def may_measure(n, chunk: int) -> bool:
    """Whether a write of ``n`` tokens can measure a mean (``measured``): not one of fewer than
    ``least_tokens`` (a decode step's: its length is static where traced, so its compiled
    write holds none of ``measured``'s maths); a symbolic length (a traced prefill's) may."""
    return not isinstance(n, int) or n >= least_tokens(chunk)


def rows_for(tokens, chunk: int):
    """Rows a dynamic store's table keeps for ``tokens`` tokens: every chunk they reach and
    one more."""
    return (tokens + chunk - 1) // chunk + 1


def grown(means: torch.Tensor, rows) -> torch.Tensor:
    """``means (b, rows₀, r)`` to ``rows`` rows (at least ``rows₀``), each new row the
    last's."""
    return spread(means, rows, 1)  # a gather: contiguous as every step's table (guarded strides)


def offsets(means: torch.Tensor) -> torch.Tensor:
    """Each chunk's offset ``(b, rows, r)``: its row less the first's, in float32 wherever it
    is read (so eager and compiled reads agree for a 16-bit model)."""
    means = means.float()
    return means - means[:, :1]


def row_of(positions: torch.Tensor, rows: int, chunk: int) -> torch.Tensor:
    """The table row of each cache position (past the table: its last row)."""
    return (positions // chunk).clamp_max(rows - 1)


def offsets_at(means: torch.Tensor, start, n: int, chunk: int) -> torch.Tensor:
    """The offsets ``(b, n, r)`` of positions ``start .. start + n`` (``start`` an int or a
    0-d tensor)."""
    positions = start + torch.arange(n, device=means.device)
    return offsets(means).index_select(1, row_of(positions, means.shape[1], chunk))


def spread(table: torch.Tensor, slots: int, chunk: int, dim: int = 1) -> torch.Tensor:
    """``table``, indexed by row along ``dim``, indexed by position ``0 .. slots``."""
    at = row_of(torch.arange(slots, device=table.device), table.shape[dim], chunk)
    return table.index_select(dim, at)


def measured(means: torch.Tensor, z: torch.Tensor, start, sink_at: torch.Tensor | None,
             chunk: int) -> torch.Tensor:
    """``means`` after a write of latents ``z (b, n, r)`` from cache position ``start``: where
    the write starts at position 0 and holds at least ``least_tokens`` of the first chunk's
    tokens past each row's sink (``sink_at (b,)``, None: position 0), every chunk it holds as
    many tokens of gets its mean, and every later row the last such mean; other rows and
    other writes leave ``means`` as it was."""
    b, n, r = z.shape
    rows = means.shape[1]
    positions = start + torch.arange(n, device=z.device)
    at = torch.zeros(b, dtype=torch.long, device=z.device) if sink_at is None else sink_at
    after_sink = (positions[None] > at.to(z.device)[:, None]).float()  # (b, n)
    row = row_of(positions, rows, chunk)
    sums = z.new_zeros(b, rows, r, dtype=torch.float32).index_add(
        1, row, z.float() * after_sink[..., None])
    counts = after_sink.new_zeros(b, rows).index_add(1, row, after_sink)
    enough = counts >= least_tokens(chunk)  # (b, rows)
    prefill = (positions[:1] == 0) & enough[:, :1]  # (b, 1): this write measures the first chunk
    took = prefill & enough
    index = torch.arange(rows, device=z.device)
    last = torch.where(took, index, -1).cummax(1).values  # each row's last measured row
    mean = (sums / counts.clamp_min(1)[..., None]).to(means.dtype)
    filled = mean.gather(1, last.clamp_min(0)[..., None].expand(-1, -1, r))
    return torch.where((last >= 0)[..., None], filled, means)
