"""Spectra whose energies are the error a dropped row causes, comparable across projections.

Every basis is an orthonormal set of rows in cache coordinates, ranked by the error dropping a
row causes. For the rank allocation to trade one projection against another, those errors
must be in one unit:

- ``relative``: the share of the projection's own energy (weight-only and whitened bases);
- ``attention_spectra``: the first-order change of the layer's attention output, relative to
  that output's energy (``lorc_fx.attention_probe`` measures what it needs). Values are exact
  to first order; keys go through the softmax's derivative.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .attention_probe import AttentionMoments
from lorc_fx.analysis.records import RopeLayout
from .spectra import Spectrum, real_spectrum, rope_commuting_spectrum, weighted_spectrum

_JITTER = 1e-10


def relative(spectrum: Spectrum) -> Spectrum:
    """The same rows with energies as shares of the total."""
    total = float(spectrum.energy.sum())
    return replace(spectrum, energy=spectrum.energy / total if total > 0 else spectrum.energy)


def _sqrt_and_inverse_sqrt(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, u = torch.linalg.eigh(a)
    w = w.clamp_min(_JITTER * float(w.max().clamp_min(1e-300)))
    return (u * w.sqrt()) @ u.mT, (u * w.rsqrt()) @ u.mT


def geometric_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a # b = a^½ (a^-½ b a^-½)^½ a^½``: for commuting ``a``, ``b`` its eigenvectors are
    theirs with eigenvalues ``√(aᵢ bᵢ)``, so its leading directions are those where the
    product of both second moments (the error of a two-sided bilinear form) is largest."""
    root, inverse_root = _sqrt_and_inverse_sqrt(a)
    middle, _ = _sqrt_and_inverse_sqrt(inverse_root @ b @ inverse_root)
    out = root @ middle @ root
    return (out + out.mT) / 2


def factor(moment: torch.Tensor) -> torch.Tensor:
    """``R`` with ``R Rᵀ = moment``: spectra of ``R`` are the moment's eigen-directions."""
    moment = moment.to(torch.float64)
    jitter = _JITTER * float(moment.diagonal().mean()) + 1e-30
    return torch.linalg.cholesky(moment + jitter * torch.eye(moment.shape[0], dtype=torch.float64))


def _quadratic(rows: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.einsum("ij,jk,ik->i", rows, a, rows)


def ranked(spectrum: Spectrum, cost: torch.Tensor) -> Spectrum:
    """The spectrum's rows reordered by ``cost`` per row (most costly to drop first), keeping
    each unit of rows that must be cut together (a complex direction's pair) together; the
    energy of a row becomes its unit's mean cost."""
    cuts = spectrum.valid_ranks
    units = sorted(zip(cuts[:-1], cuts[1:]), key=lambda u: -float(cost[u[0]:u[1]].mean()))
    order = torch.cat([torch.arange(a, b) for a, b in units])
    energy = torch.cat([cost[a:b].mean().expand(b - a) for a, b in units])
    flags = [True]
    for a, b in units:
        flags += [False] * (b - a - 1) + [True]
    rebuild = None if spectrum.rebuild_rows is None else spectrum.rebuild_rows[order]
    return Spectrum(spectrum.rows[order], energy.to(torch.float64), torch.tensor(flags), rebuild)


def attention_key_spectrum(m: AttentionMoments, num_kv_heads: int, head_dim: int,
                           rope: RopeLayout) -> Spectrum:
    """Post-RoPE key basis from the two-sided score metric (keys ⊗ queries), RoPE-commuting
    where the keys rotate; row energy ``s²(uᵀQu)(uᵀKu) / E‖o‖²``."""
    metric = factor(geometric_mean(m.keys, m.queries))
    spectrum = (rope_commuting_spectrum(metric, num_kv_heads, head_dim, rope)
                if rope.style != "none" else real_spectrum(metric))
    cost = m.scale ** 2 * _quadratic(spectrum.rows, m.queries) * _quadratic(spectrum.rows, m.keys)
    return ranked(spectrum, cost / m.output_energy)


def rotation_averaged_query_energy(queries: torch.Tensor, num_kv_heads: int, head_dim: int,
                                   rope: RopeLayout) -> torch.Tensor:
    """Diagonal of the (group-summed) query moment averaged over the rotations RoPE puts
    between a query and a key: both dims of a rotary pair get the pair's mean, pass-through
    dims keep their own."""
    energy = queries.diagonal().clone().reshape(num_kv_heads, head_dim)
    for a, b in rope.pairs():
        energy[:, a] = energy[:, b] = (energy[:, a] + energy[:, b]) / 2
    return energy.reshape(-1)


def attention_pre_rope_key_spectrum(m: AttentionMoments, weight: torch.Tensor,
                                    gram: torch.Tensor, num_kv_heads: int, head_dim: int,
                                    rope: RopeLayout) -> Spectrum:
    """Key basis for keys cached before RoPE (``rope='reconstruct'``).

    A pre-RoPE key error ``e`` moves a score by ``qᵀ R e``, ``R`` the rotation between the
    two positions; averaged over rotations its energy is ``eᵀ diag(q̄²) e``, so the basis is
    the oblique one that minimises the query-weighted key error (``weighted_spectrum``).
    Energies are scaled to the total error the post-RoPE score metric assigns keys, the
    unit values are ranked in.
    """
    spectrum = relative(weighted_spectrum(
        weight, gram, rotation_averaged_query_energy(m.queries, num_kv_heads, head_dim, rope)))
    total = float(attention_key_spectrum(m, num_kv_heads, head_dim, rope).energy.sum())
    return replace(spectrum, energy=spectrum.energy * total)


def attention_value_spectrum(m: AttentionMoments, head_dim: int,
                             token_moment: torch.Tensor | None = None) -> Spectrum:
    """Value basis from the attention-averaged value moment, plus (when given) the per-token
    value moment ``E[v vᵀ]``, each scaled to unit trace: the averaged moment alone is nearly
    low-rank and fits the calibration text's attention patterns; the per-token one keeps
    the directions other text uses (measured: it lowers the loss on held-out calibration
    windows and on both evaluation texts). Row energy: the exact first-order output error
    ``Σ_j ‖u_j‖² uᵀ V_j u / E‖o‖²`` (head group ``j`` reads block ``u_j`` of a dropped row)."""
    averaged = m.values.sum(0)
    metric = averaged / averaged.trace()
    if token_moment is not None:
        metric = metric + token_moment.to(torch.float64) / token_moment.trace()
    spectrum = real_spectrum(factor(metric))
    rows = spectrum.rows
    cost = sum(rows[:, j * head_dim:(j + 1) * head_dim].square().sum(1) * _quadratic(rows, v)
               for j, v in enumerate(m.values))
    return ranked(spectrum, cost / m.output_energy)
