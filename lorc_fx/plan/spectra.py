"""Bases of a projection's output space, ranked by the energy they keep.

A layer's cache latent is ``P·k`` for a basis ``P`` whose rows are a prefix of a
:class:`Spectrum`, rebuilt as ``Bᵀ·(P·k)``. Most bases we build (weight-only SVD,
activation-whitened SVD, the RoPE-commuting complex basis) are orthonormal, ``B = P``; they
differ only in the input metric ``G`` (``E[x xᵀ]`` of the projection input, identity for
weight-only SVD) and in whether directions must stay invariant under RoPE. A basis chosen
under an output metric too (:func:`weighted_spectrum`) is oblique: ``B ≠ P``, ``B Pᵀ = I``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lorc_fx.analysis.records import RopeLayout

_JITTER = 1e-10


@dataclass
class Spectrum:
    """Rows of a basis, most important first.

    ``energy[i]`` is the expected squared norm row ``i`` keeps of the projected input under
    the input metric; ``cuts[r]`` says whether the first ``r`` rows form a valid basis
    (a RoPE-commuting basis cannot split the real/imaginary pair of a complex direction).
    """

    rows: torch.Tensor  # (width, width) float64: P, orthonormal unless rebuild_rows is set
    energy: torch.Tensor  # (width,) float64, non-increasing
    cuts: torch.Tensor  # (width + 1,) bool
    rebuild_rows: torch.Tensor | None = None  # B of an oblique basis (B Pᵀ = I); None: B = P

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    def basis(self, rank: int) -> torch.Tensor:
        if rank not in self.valid_ranks:
            raise ValueError(f"rank {rank} splits a complex direction of a RoPE-commuting basis")
        return self.rows[:rank]

    def rebuild(self, rank: int) -> torch.Tensor:
        """The rows whose transpose maps a rank-``rank`` latent back to the projection's
        output space."""
        rows = self.rows if self.rebuild_rows is None else self.rebuild_rows
        return rows[:self.basis(rank).shape[0]]

    def dropped_energy(self, rank: int) -> float:
        return float(self.energy[rank:].sum())

    @cached_property
    def valid_ranks(self) -> list[int]:
        return torch.nonzero(self.cuts).flatten().tolist()


def block_diagonal(parts: list[Spectrum]) -> Spectrum:
    """One spectrum of ``len(parts)`` equal blocks of output dims (shard ``s`` owns dims
    ``[s·w, (s+1)·w)``), each block's rows kept only on its own dims, the same number in every
    block: row ``j·S + s`` is row ``j`` of part ``s``, and a rank is valid where it is ``S·r``
    for an ``r`` valid in every part. So the latent of each shard is read from that shard's
    dims alone, and ``rows[s::S]`` restricted to them is the shard's own basis."""
    count, width = len(parts), parts[0].width
    if any(p.width != width for p in parts):
        raise ValueError("the shards of a block-diagonal spectrum must be equally wide")
    full = count * width

    def embed(part_rows: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(full, full, dtype=torch.float64)
        for s, rows in enumerate(part_rows):
            out[s::count, s * width:(s + 1) * width] = rows.to(torch.float64)
        return out

    rebuild = None
    if any(p.rebuild_rows is not None for p in parts):
        rebuild = embed([p.rows if p.rebuild_rows is None else p.rebuild_rows for p in parts])
    energy = torch.stack([p.energy.to(torch.float64) for p in parts], dim=1).reshape(-1)
    per_shard = torch.stack([p.cuts for p in parts]).all(0)  # (width + 1,)
    cuts = torch.zeros(full + 1, dtype=torch.bool)
    cuts[::count] = per_shard
    return Spectrum(embed([p.rows for p in parts]), energy, cuts, rebuild)


def _input_root(gram: torch.Tensor | None, dim: int) -> torch.Tensor | None:
    """``S`` with ``S Sᵀ = G`` (Cholesky, jittered to stay positive definite)."""
    if gram is None:
        return None
    gram = gram.to(torch.float64)
    jitter = _JITTER * float(gram.diagonal().mean()) + 1e-30
    return torch.linalg.cholesky(gram + jitter * torch.eye(dim, dtype=torch.float64))


def _metric_weight(weight: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    w = weight.to(torch.float64)
    root = _input_root(gram, w.shape[1])
    return w if root is None else w @ root


def singular_values(weight: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(weight.to(torch.float64))


def condition_number(weight: torch.Tensor) -> float:
    s = singular_values(weight)
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")


def _left_singular(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Square ``U`` (batched) and squared singular values padded with zeros to its width.

    Only the thin SVD is computed (the input side can be wide); when the output side is
    the larger one, ``U`` is completed to a square unitary matrix by QR.
    """
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    rows = a.shape[-2]
    energy = torch.zeros(*a.shape[:-2], rows, dtype=torch.float64)
    energy[..., : s.shape[-1]] = s.square()
    if u.shape[-1] < rows:
        filler = torch.randn(*a.shape[:-2], rows, rows - u.shape[-1], dtype=u.dtype,
                             generator=torch.Generator().manual_seed(0))
        u = torch.linalg.qr(torch.cat([u, filler], dim=-1)).Q
    return u, energy


def real_spectrum(weight: torch.Tensor, gram: torch.Tensor | None = None) -> Spectrum:
    """Left singular vectors of ``W·S``: the best rank-r output subspaces under metric ``G``."""
    u, energy = _left_singular(_metric_weight(weight, gram))
    return Spectrum(u.T.contiguous(), energy, torch.ones(weight.shape[0] + 1, dtype=torch.bool))


def weighted_spectrum(weight: torch.Tensor, gram: torch.Tensor | None,
                      output_weights: torch.Tensor) -> Spectrum:
    """The best rank-r reconstructions of ``W·x`` under input metric ``G`` and the diagonal
    output metric ``M = diag(output_weights)``: with ``M^½ W S = U Σ Vᵀ``, latent rows
    ``P = Uᵀ M^½`` and rebuild rows ``B = Uᵀ M^-½``, so ``Bᵣᵀ Pᵣ = M^-½ Uᵣ Uᵣᵀ M^½`` (an
    oblique projection) minimises ``E‖M^½ (W x − Bᵣᵀ Pᵣ W x)‖²``; ``energy`` is ``σ²``."""
    m = output_weights.to(torch.float64).clamp_min(_JITTER * float(output_weights.max()))
    u, energy = _left_singular(m.sqrt()[:, None] * _metric_weight(weight, gram))
    return Spectrum((u.T * m.sqrt()).contiguous(), energy,
                    torch.ones(weight.shape[0] + 1, dtype=torch.bool),
                    (u.T * m.rsqrt()).contiguous())


def rope_commuting_spectrum(
    weight: torch.Tensor, num_heads: int, head_dim: int, rope: RopeLayout,
    gram: torch.Tensor | None = None,
) -> Spectrum:
    """A basis of post-RoPE keys that RoPE maps onto itself (docs/design.md, "Keys: three cases", case 3).

    For each rotary frequency ``t`` the pair ``(a_t, b_t)`` of every KV head is one complex
    number, the same rotation acting on all heads; any complex subspace of ``C^{h_kv}`` is
    invariant. The SVD of the complex ``M_t = W[a_t] + i·W[b_t]`` (one row per head) gives,
    per complex direction ``u``, two real rows ``(Re u, Im u)`` and ``(-Im u, Re u)`` on the
    pair's dims, each keeping half of ``σ²``. Pass-through dims (partial rotary) get an
    ordinary real SVD. All directions are merged by energy per real row.
    """
    w = _metric_weight(weight, gram)
    width = num_heads * head_dim
    heads = torch.arange(num_heads) * head_dim
    units: list[tuple[float, list[torch.Tensor]]] = []  # (energy per row, rows)

    pairs = torch.tensor(rope.pairs(), dtype=torch.long).reshape(-1, 2)
    if len(pairs):
        re_idx = heads[None, :] + pairs[:, :1]  # (frequencies, heads)
        im_idx = heads[None, :] + pairs[:, 1:]
        u, energy = _left_singular(torch.complex(w[re_idx], w[im_idx]))
        for f in range(len(pairs)):
            for col in range(num_heads):
                vec = u[f, :, col]
                re_row = torch.zeros(width, dtype=torch.float64)
                im_row = torch.zeros(width, dtype=torch.float64)
                re_row[re_idx[f]], re_row[im_idx[f]] = vec.real, vec.imag
                im_row[re_idx[f]], im_row[im_idx[f]] = -vec.imag, vec.real
                units.append((float(energy[f, col]) / 2, [re_row, im_row]))

    passthrough = torch.arange(rope.rotary_dim, head_dim)
    if len(passthrough):
        idx = (heads[:, None] + passthrough[None, :]).reshape(-1)
        sub = real_spectrum(w[idx])
        for row, e in zip(sub.rows, sub.energy.tolist()):
            full = torch.zeros(width, dtype=torch.float64)
            full[idx] = row
            units.append((e, [full]))

    units.sort(key=lambda unit: -unit[0])
    rows, energy, cuts = [], [], [True]
    for e, unit_rows in units:
        for i, row in enumerate(unit_rows):
            rows.append(row)
            energy.append(e)
            cuts.append(i == len(unit_rows) - 1)
    return Spectrum(torch.stack(rows), torch.tensor(energy, dtype=torch.float64),
                    torch.tensor(cuts))
