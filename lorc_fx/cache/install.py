"""Make a model's ``generate`` build a latent cache, and hand pre-RoPE latents their angles.

``install(model, plan, blocks)`` is all ``lorc_fx.compress`` changes on a model: it keeps
the plan on the model, wraps ``_prepare_cache_for_generation`` so the fresh
``DynamicCache``/``StaticCache`` that ``generate`` builds (or the model's own cache class, which
it leaves to the model) becomes a :class:`LatentCache`
(static where the model is compiled and the caller chose no cache: it decodes faster),
wraps ``prepare_inputs_for_generation`` so that cache's growing axes are marked dynamic
before every step (one compiled decode graph; a model whose ``generate`` prepares no cache
gets its latent cache there, before the first forward), and, for keys cached before RoPE,
puts a forward pre-hook on each attention module that hands the cache the step's
``(cos, sin)``. Its ``save_pretrained`` (where the class has one)
warns once that it saves the plain model, not the plan.
"""
from __future__ import annotations

import logging
import types
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation.configuration_utils import GenerationMode

from lorc_fx.analysis.cache_probe import fresh_cache, own_cache_class
from lorc_fx.analysis.records import AttentionBlock, attention_module
from lorc_fx.plan.planner import PLANNED, Plan, process_plan

from .latent_cache import LatentCache, static_latent_layers

log = logging.getLogger(__name__)


def latent_cache(model: nn.Module, max_cache_len: int | None = None,
                 prefill_as_stored: bool = False) -> LatentCache:
    """A fresh latent cache for a compressed model (dynamic, or static with ``max_cache_len``);
    ``prefill_as_stored``: a prefill attends its own tokens read back as stored, not as it
    computed them (``LatentCache.from_cache``)."""
    if max_cache_len is None:
        base = fresh_cache(model)
    elif own_cache_class(model) is not None:
        raise ValueError(f"{type(model).__name__} caches in a class of its own "
                         f"({own_cache_class(model).__name__}), which has no static form: use "
                         "the dynamic cache")
    else:
        base = StaticCache(config=model.config.get_text_config(decoder=True),
                           max_cache_len=max_cache_len)
    return LatentCache.from_cache(base, model._lorc_plan, prefill_as_stored)


def _latent_caches_written(values) -> list[LatentCache]:
    """The latent caches an attention call writes: a latent cache among its arguments, or those
    a cache among them writes beside itself (its ``latents``: ``eval.retrieval``'s prefill)."""
    found = []
    for value in values:
        if isinstance(value, LatentCache):
            found.append(value)
        elif isinstance(value, Cache):  # only caches: no attribute lookups on tensors each step
            found += [c for c in getattr(value, "latents", ()) if isinstance(c, LatentCache)]
    return found


def _hand_angles_to_cache(module, args, kwargs):
    """Forward pre-hook: give the latent caches the call writes the incoming tokens' RoPE angles."""
    angles = kwargs.get("position_embeddings")
    if angles is None:
        return
    for cache in _latent_caches_written((*args, *kwargs.values())):
        if cache.rotary is not None:
            cache.rotary.pending = angles


def _angle_hooks(model: nn.Module, blocks: list[AttentionBlock], *plans: Plan
                 ) -> list[RemovableHandle]:
    """Pre-hooks on the attention of every layer whose keys a plan caches before RoPE."""
    pre_rope = {l.layer for plan in plans for l in plan.layers
                if not l.skipped and l.k_compressible and l.k_latent_of == "pre_rope"}
    return [attention_module(model, b).register_forward_pre_hook(_hand_angles_to_cache,
                                                                  with_kwargs=True)
            for b in blocks if b.layer in pre_rope]


@contextmanager
def angles_handed(model: nn.Module, blocks: list[AttentionBlock], *plans: Plan | None):
    """Within the block, latent caches of the ``plans`` (``None``: none) receive their RoPE
    angles."""
    handles = _angle_hooks(model, blocks, *(p for p in plans if p is not None))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# generate's modes that never crop the cache (assisted and prompt-lookup decoding, contrastive
# search and DoLa do: a static cache cannot)
_STATIC_SAFE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE,
                      GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)

# the static latent cache ``generate`` builds where the caller chose none holds a whole number
# of these tokens: a later call that needs a few more slots reuses it (transformers keeps the
# longest static cache a model's calls asked for) instead of recompiling, which costs minutes
# on a compiled plan (README, "Limitations")
STATIC_LENGTH_STEP = 256


def _static_is_faster(model, generation_config, model_kwargs, generation_mode) -> bool:
    """Whether ``generate`` should build a static latent cache where the caller chose none.

    Compiled, a dynamic latent layer copies its codes into a grown tensor every step where a
    static one writes the step's codes in place: plain int8 after a 4096-token prompt decodes
    at 4.6 tok/s over a dynamic cache against 9.1 over a static one (one thread,
    bench/results/long_context_cache_choice-cpu.md). Eager, the static cache is the slower
    (6.0 against 7.3 at 1024 tokens), so only a model compiled in place (``model.compile``)
    gets one, only where the caller passed neither a cache nor ``cache_implementation``, and
    only where every layer the plan codes has a static latent layer (not hybrid or indexed
    ones yet)."""
    return (getattr(model, "_compiled_call_impl", None) is not None
            and generation_config.cache_implementation is None
            and model_kwargs.get("past_key_values") is None
            and generation_mode in _STATIC_SAFE_MODES
            and model._lorc_plan.scheme.capabilities.static_cache
            and static_latent_layers(model.config)
            and own_cache_class(model) is None
            and (model._lorc_plan.options.shards or 1) == 1)  # sharded: static untested


def _prepare_latent_cache(self, generation_config, model_kwargs, generation_mode, *args,
                          **kwargs):
    """``generate``'s cache preparation, with the fresh cache swapped for a latent one (a
    static one for a compiled model, where the caller chose no cache: ``_static_is_faster``)."""
    if _static_is_faster(self, generation_config, model_kwargs, generation_mode):
        if not getattr(self, "_lorc_static_said", False):
            self._lorc_static_said = True
            log.warning("the compiled model decodes faster over a static latent cache, so "
                        "generate builds one (cache_implementation='static', a multiple of "
                        f"{STATIC_LENGTH_STEP} tokens long, which later calls reuse); pass "
                        "cache_implementation='dynamic' to keep the dynamic cache")
        steps = -(-generation_config.max_length // STATIC_LENGTH_STEP)
        generation_config.cache_implementation = "static"  # generate's own copy of the config
        generation_config.max_cache_len = max(generation_config.max_cache_len or 0,
                                              steps * STATIC_LENGTH_STEP)
    type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs,
                                             generation_mode, *args, **kwargs)
    own = own_cache_class(self)
    if own is not None and generation_config.use_cache is not False \
            and model_kwargs.get("past_key_values") is None:
        model_kwargs["past_key_values"] = own()  # generate builds none: the forward would
    self._lorc_generate_prepares = True
    cache = model_kwargs.get("past_key_values")
    if cache is not None and not getattr(cache, "_is_user_defined", False) \
            and type(cache) in (DynamicCache, StaticCache, own):
        model_kwargs["past_key_values"] = LatentCache.from_cache(cache, self._lorc_plan)
        _place_sinks(model_kwargs["past_key_values"], model_kwargs.get("attention_mask"))


def _place_sinks(cache: LatentCache, mask) -> None:
    """A fresh latent cache's sinks after each row's left padding (``mask``: 2-D, or none)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        cache.place_sinks((mask.cumsum(-1) == 0).sum(-1))


def _prepare_inputs_marking_dynamic(self, *args, **kwargs):
    """``generate``'s per-step input preparation (eager, before each forward), with the
    latent cache's growing axes marked dynamic first: a compiled decode then traces one graph
    for every length (``LatentCache.mark_dynamic``).

    A model whose own ``generate`` never prepares a cache and lets its forward build one
    (MusicGen-Melody: an ``EncoderDecoderCache`` of two dynamic caches) gets a latent cache
    here instead, before its first forward."""
    inputs = type(self).prepare_inputs_for_generation(self, *args, **kwargs)
    if ("past_key_values" in inputs and inputs["past_key_values"] is None
            and inputs.get("use_cache") and not getattr(self, "_lorc_generate_prepares", False)):
        inputs["past_key_values"] = latent_cache(self)
        _place_sinks(inputs["past_key_values"], inputs.get("attention_mask"))
    if isinstance(cache := inputs.get("past_key_values"), LatentCache):
        cache.mark_dynamic()
    return inputs


def _save_pretrained_plain(self, *args, **kwargs):
    """The class's ``save_pretrained``, after one warning per model that what it writes is
    the plain model (the plan lives apart, in a plan file)."""
    if not getattr(self, "_lorc_save_warned", False):
        self._lorc_save_warned = True
        log.warning(
            "save_pretrained writes the plain %s: the LoRC plan that lorc_fx.compress installed "
            "is not part of it, so a reloaded model caches full keys and values. Save the plan "
            "too with lorc_fx.save_plan(model, PATH) (or report.save(PATH)); after loading, "
            "lorc_fx.compress(model, plan=PATH) installs it without calibrating or planning",
            type(self).__name__)
    return type(self).save_pretrained(self, *args, **kwargs)


_LIMITS_SAID: set[str] = set()  # the schemes whose limits this process has warned of, once each


def install(model: nn.Module, plan: Plan, blocks: list[AttentionBlock]) -> None:
    """Make ``model.generate`` cache latents of ``plan`` (replacing an earlier install); a
    tensor-parallel process caches its own shard's (``_lorc_plan``), and keeps the whole
    plan (``_lorc_whole_plan``) to save."""
    model._lorc_whole_plan = plan
    for parameter in model.parameters():  # lorc_backend leaves their attention to this plan
        setattr(parameter, PLANNED, True)
    own_cache_class(model)  # found now, before a compile: generate asks it every call
    model._lorc_plan = plan = process_plan(plan, blocks)
    limits = plan.scheme.limits()
    if limits and plan.scheme.name not in _LIMITS_SAID:
        _LIMITS_SAID.add(plan.scheme.name)
        log.warning("this plan stores the cache as %s: %s", plan.scheme.title, limits)
    for handle in getattr(model, "_lorc_hooks", []):
        handle.remove()
    model._lorc_hooks = _angle_hooks(model, blocks, plan)
    model._prepare_cache_for_generation = types.MethodType(_prepare_latent_cache, model)
    model.prepare_inputs_for_generation = types.MethodType(_prepare_inputs_marking_dynamic, model)
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(_save_pretrained_plain, model)
