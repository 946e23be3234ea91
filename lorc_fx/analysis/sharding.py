"""Tensor-parallel projections: which shard of the K/V heads this process holds.

A model loaded with transformers' ``tp_plan`` holds its projection weights as DTensors; its
attention runs on each process's *local* heads, so the graphs the analysis captures (and the
``AttentionBlock`` it reports: heads, rows) are this process's. ``Sharding`` says how those
local rows sit in the whole model: shard ``index`` of ``count`` equal blocks of output rows,
in order (transformers' ``colwise`` plan), the same split for keys and values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class Sharding:
    count: int  # processes the K/V heads are split over (the tensor-parallel world)
    index: int  # the shard this process holds: output rows [index·n, (index+1)·n) of each


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every process must call it, in the same
    order), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def weight_sharding(weight: torch.Tensor, transposed: bool) -> Sharding | None | str:
    """How the output rows of a projection weight are split: ``None`` where the weight is
    whole on this process, a reason (str) where the split is not one the plan can follow."""
    if not isinstance(weight, DTensor):
        return None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    out_dim = 1 if transposed else 0
    if mesh.ndim != 1:
        return f"weight sharded over a {mesh.ndim}-d device mesh (only 1-d is supported)"
    if all(p.is_replicate() for p in placements):
        return None
    if placements != (Shard(out_dim),):
        return f"weight placements {placements}: only output rows split evenly (Shard({out_dim})) are supported"
    count = mesh.size()
    if weight.shape[out_dim] % count:
        return f"{weight.shape[out_dim]} output rows do not split evenly over {count} processes"
    return Sharding(count, mesh.get_local_rank())


def block_sharding(k: tuple[torch.Tensor, bool], v: tuple[torch.Tensor, bool]) -> Sharding | None | str:
    """The split of a block's K and V projections ((weight, transposed) each), which must
    agree; a reason where they do not, or where either cannot be followed."""
    found = [weight_sharding(w, t) for w, t in (k, v)]
    for role, f in zip("KV", found):
        if isinstance(f, str):
            return f"{role} projection: {f}"
    if found[0] != found[1]:
        return f"K and V projections are split differently ({found[0]} vs {found[1]})"
    return found[0]


def model_split(blocks) -> Sharding | None:
    """The tensor-parallel split of a model's supported attention blocks (one for all of
    them), or None where their weights are whole on this process."""
    splits = {b.sharding for b in blocks if b.supported}
    if len(splits) > 1:
        raise ValueError(f"the attention blocks are split differently over processes: {splits}")
    return next(iter(splits), None)
