"""Calibration windows run through a plan's latent cache: what every measurement of this
stage reads (a candidate's loss, the key rows' rounding errors)."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lorc_fx.analysis.cache_probe import fresh_cache
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache import LatentCache, angles_handed
from lorc_fx.plan.planner import Plan

BATCH = 2  # windows per forward


@torch.no_grad()
def through_cache(model: nn.Module, blocks: list[AttentionBlock], plan: Plan | None,
                  windows: torch.Tensor) -> Iterator[tuple[torch.Tensor, object, LatentCache | None]]:
    """Each batch of ``windows`` (on the model's device), the model's output on it and the
    fresh latent cache of ``plan`` it ran through (of ``blocks``, whose attention hands
    pre-RoPE latents their angles); without a plan, the model uncached and ``None``. Iterate
    to the end: the attention is patched until then.

    The window's forward attends its tokens read back as stored (``prefill_as_stored``):
    what a decode step reads, where a prefill would attend them as it computed them."""
    device = next(model.parameters()).device
    with angles_handed(model, blocks, plan):
        for batch in windows.split(BATCH):
            batch = batch.to(device)
            if plan is None:
                yield batch, model(batch, use_cache=False), None
            else:
                cache = LatentCache.from_cache(fresh_cache(model), plan,
                                              prefill_as_stored=True)
                yield batch, model(batch, use_cache=True, past_key_values=cache), cache
