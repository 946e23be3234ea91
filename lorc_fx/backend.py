"""``lorc_backend``: the torch.compile backend.

analyse graph → plan ranks → (the latent cache, built by ``compress``) → rewrite → Inductor.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

from passes.absorb_latent_attention import absorb_latent_attention
from passes.lower_latent_ops import lower_latent_ops

log = logging.getLogger(__name__)


def lorc_backend(gm: fx.GraphModule, example_inputs, *, inductor: bool = True):
    absorbed = absorb_latent_attention(gm)
    lowered = lower_latent_ops(gm)
    log.info("lorc_backend: %d attention ops absorbed, %d latent ops lowered", absorbed, lowered)
    if not inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs)
