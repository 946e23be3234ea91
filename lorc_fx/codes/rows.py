"""Row codes: the last axis of any tensor in groups of ``group`` values, each group stored as
signed ``bits``-bit integers under one shared power-of-two scale (OCP Microscaling's MXINT
layout: the scale an 8-bit exponent, E8M0), so a value costs ``bits + 8/group`` bits.

Why a power of two: decoding and coding again gives the same codes and exponents, exactly,
in any float dtype a cache holds (a code times a power of two is exact even in bfloat16). A
cache layer that rewrites what it read back (transformers' sliding window, cut from the
concatenation of the decoded window and the new tokens; a compressor's buffer of pending
tokens) therefore never drifts, however many steps it rewrites the same rows. Per-group
integer scales (``codes.integer``) would: their scale is recomputed from decoded values and
rounded, and creeps. The price is under a bit of resolution where a group's largest value
is just above a power of two.

Layout: ``codes`` unsigned ``(..., groups, group·bits/8)`` (``q + 2^(bits-1)``, packed by
``integer.pack_bits``), ``exponents`` int8 ``(..., groups)``; a group is the largest divisor
of the last axis up to ``spec.group`` (a row never shares a scale with the next). This module
imports nothing from lorc_fx but ``integer``'s packing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .integer import pack_bits, unpack_bits

ROW_BITS = (8, 4)
EXPONENT_BITS = 8


@dataclass(frozen=True)
class RowSpec:
    """``bits`` (8 or 4) per value and one power-of-two scale per ``group`` values of a row."""

    bits: int
    group: int

    def __post_init__(self):
        if self.bits not in ROW_BITS:
            raise ValueError(f"row codes take bits {ROW_BITS}, not {self.bits}")
        if self.group < 2 or self.group % 2:
            raise ValueError(f"a row code's group must be an even number of values, not "
                             f"{self.group}")

    def group_of(self, width: int) -> int:
        """Values per scale in a row of ``width``: the largest divisor up to ``group``."""
        return max(g for g in range(1, min(width, self.group) + 1) if width % g == 0)

    def bits_per_value(self, width: int | None = None) -> float:
        """Bits a value of a row of ``width`` (default: whole groups) costs, its scale counted."""
        return self.bits + EXPONENT_BITS / (self.group if width is None else self.group_of(width))


@dataclass(frozen=True)
class RowCodes:
    """A tensor of ``shape`` and ``dtype`` as row codes (module docstring)."""

    codes: torch.Tensor
    exponents: torch.Tensor
    bits: int
    shape: tuple
    dtype: torch.dtype

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.exponents

    def decode(self) -> torch.Tensor:
        half = 1 << (self.bits - 1)
        q = unpack_bits(self.codes, self.bits).to(torch.int32) - half
        values = q.float() * _power_of_two(self.exponents)[..., None]
        return values.reshape(self.shape).to(self.dtype)


def _power_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """``2^e`` as float32, exactly."""
    exponents = exponents.to(torch.int32)
    return torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents)


def encode(x: torch.Tensor, spec: RowSpec) -> RowCodes:
    """``x``'s rows as codes of ``spec``: each group's scale the least power of two that
    puts its largest magnitude within ``2^(bits-1) - 1`` steps."""
    group = spec.group_of(x.shape[-1])
    if (group * spec.bits) % 8:
        raise ValueError(f"rows of {x.shape[-1]} values cannot be coded in whole bytes at "
                         f"{spec.bits} bits")
    top = (1 << (spec.bits - 1)) - 1
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    mantissa, exponent = torch.frexp(g.abs().amax(-1) / top)  # amax/top = m·2^e, m in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).int()  # an exact power of two is its own scale
    exponent = exponent.clamp(-126, 127)  # a float32 normal scale (smaller values code to 0)
    q = torch.round(g / _power_of_two(exponent)[..., None]).clamp(-top, top) + (top + 1)
    return RowCodes(pack_bits(q.to(torch.uint8), spec.bits), exponent.to(torch.int8), spec.bits,
                    tuple(x.shape), x.dtype)


def packed(coded: RowCodes) -> torch.Tensor:
    """``coded`` as one uint8 tensor ``(..., bytes)``: each row's codes, then its groups'
    exponents (what a cache's batch operations can act on as one tensor)."""
    codes = coded.codes.flatten(-2)
    return torch.cat([codes, coded.exponents.view(torch.uint8)], dim=-1)


def unpacked(row_bytes: torch.Tensor, spec: RowSpec, width: int, dtype: torch.dtype) -> RowCodes:
    """The row codes :func:`packed` wrote for rows of ``width`` values of ``dtype``."""
    group = spec.group_of(width)
    groups = width // group
    codes = row_bytes[..., :-groups].unflatten(-1, (groups, group * spec.bits // 8))
    exponents = row_bytes[..., -groups:].contiguous().view(torch.int8)
    return RowCodes(codes, exponents, spec.bits, (*row_bytes.shape[:-1], width), dtype)


def nbytes(shape, spec: RowSpec) -> int:
    """Bytes :func:`encode` stores for a tensor of ``shape``."""
    rows, width = math.prod(shape[:-1]), shape[-1]
    group = spec.group_of(width)
    return rows * (width // group) * (group * spec.bits // 8 + EXPONENT_BITS // 8)
