"""``compress(model)``: plan the ranks and make ``generate`` cache latents."""
from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.cache_utils import DynamicCache, StaticCache

from .api import plan as make_plan
from .blocks import AttentionBlock, attention_module
from .cache import LatentCache, LayerBases
from .plan import Plan


@dataclass
class CompressionReport:
    plan: Plan
    unsupported: list[tuple[int, str]] = field(default_factory=list)  # (layer, why)
    dtype_bytes: int = 4

    def cache_bytes_per_token(self) -> tuple[int, int]:
        """(full, compressed) cache bytes per token per sequence, all planned layers; in
        ``reconstruct`` mode the compressed figure includes the RoPE angle log."""
        full, kept = self.plan.cache_elements_per_token()
        return full * self.dtype_bytes, kept * self.dtype_bytes

    def to_json(self) -> dict:
        full, kept = self.cache_bytes_per_token()
        return {**self.plan.to_json(), "cache_bytes_per_token_full": full,
                "cache_bytes_per_token_compressed": kept,
                "unsupported": [{"layer": l, "reason": r} for l, r in self.unsupported]}

    def __str__(self) -> str:
        from .report import plan_table

        full, kept = self.cache_bytes_per_token()
        lines = [plan_table(self.plan),
                 f"cache bytes per token: {full} full, {kept} compressed ({kept / full:.3f})"]
        lines += [f"layer {l} left uncompressed: {r}" for l, r in self.unsupported]
        return "\n".join(lines)


def layer_bases(plan: Plan) -> dict[int, LayerBases]:
    """Bases of every layer the plan does not skip.

    A layer at full rank still stores latents (an orthonormal change of basis), so a plan at
    fraction 1.0 runs the whole latent path and must reproduce the model exactly. A side the
    plan cannot compress (keys behind a norm) stores raw states.
    """
    bases = {}
    for l in plan.layers:
        if not l.skipped:
            bases[l.layer] = LayerBases(
                l.k_basis if l.k_compressible else None, l.v_basis if l.v_compressible else None,
                l.num_kv_heads, l.rope.style if l.k_latent_of == "pre_rope" else None,
                k_rebuild=l.k_rebuild if l.k_compressible else None,
                v_rebuild=l.v_rebuild if l.v_compressible else None)
    return bases


def latent_cache(model: nn.Module, max_cache_len: int | None = None) -> LatentCache:
    """A fresh latent cache for a compressed model (dynamic, or static with ``max_cache_len``)."""
    config = model.config.get_text_config(decoder=True)
    base = (DynamicCache(config=config) if max_cache_len is None
            else StaticCache(config=config, max_cache_len=max_cache_len))
    return LatentCache.from_cache(base, model._lorc_bases)


def _hand_angles_to_cache(module, args, kwargs):
    """Forward pre-hook: give a latent cache the RoPE angles of the incoming tokens."""
    cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, LatentCache)), None)
    angles = kwargs.get("position_embeddings")
    if cache is not None and cache.rotary is not None and angles is not None:
        cache.rotary.pending = angles


def _angle_hooks(model: nn.Module, blocks: list[AttentionBlock],
                 bases: dict[int, LayerBases]) -> list[RemovableHandle]:
    """Pre-hooks on the attention of every layer whose keys are cached before RoPE."""
    return [attention_module(model, b).register_forward_pre_hook(_hand_angles_to_cache,
                                                                  with_kwargs=True)
            for b in blocks if b.layer in bases and bases[b.layer].rope_style]


@contextmanager
def angles_handed(model: nn.Module, blocks: list[AttentionBlock],
                  bases: dict[int, LayerBases]):
    """Within the block, latent caches built from ``bases`` receive their RoPE angles."""
    handles = _angle_hooks(model, blocks, bases)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _prepare_latent_cache(self, generation_config, model_kwargs, *args, **kwargs):
    """``generate``'s cache preparation, with the fresh cache swapped for a latent one."""
    type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
    cache = model_kwargs.get("past_key_values")
    if cache is not None and not getattr(cache, "_is_user_defined", False) \
            and type(cache) in (DynamicCache, StaticCache):
        model_kwargs["past_key_values"] = LatentCache.from_cache(cache, self._lorc_bases)


def compress(model: nn.Module, cache_fraction: float = 0.6, *,
             blocks: list[AttentionBlock] | None = None, **plan_options) -> CompressionReport:
    """Plan LoRC ranks for ``model`` and make its ``generate`` use a latent KV cache.

    Returns a report: per-layer ranks, cache bytes per token full vs compressed, and the
    attention blocks left uncompressed with the reason.
    """
    if blocks is None:
        from .analysis import analyze
        blocks = analyze(model)
    plan = make_plan(model, cache_fraction, blocks=blocks, **plan_options)
    model._lorc_plan = plan
    model._lorc_bases = layer_bases(plan)
    for handle in getattr(model, "_lorc_hooks", []):
        handle.remove()
    model._lorc_hooks = _angle_hooks(model, blocks, model._lorc_bases)
    model._prepare_cache_for_generation = types.MethodType(_prepare_latent_cache, model)
    dtype = next(model.parameters()).dtype
    unsupported = [(b.layer, b.reason) for b in blocks if not b.supported]
    return CompressionReport(plan, unsupported, torch.empty((), dtype=dtype).element_size())
