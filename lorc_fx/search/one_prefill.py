"""One forward of a prompt writes the full cache and every plan's latent cache; each then reads
on by itself, as ``generate`` reads a cache.

A latent cache's prefill (a first write of more than ``PREFILL_TOKENS`` tokens) attends the
tokens it writes as it computed them (``cache.layers._PrefillAsComputed``), so the prompt's
forward is the full model's whatever the plan: one forward serves them all, and a long
prompt's forward costs far more than what each cache reads after it. Later writes (decode
steps, a few answer tokens) are read back through the codes, as a decode step reads them;
``side_by_side`` reads every cache in one forward of as many rows, each row its own cache.
A hybrid model's convolution and recurrent states are the full model's after the prefill
(written to the full cache alone), one copy a row from then on.

Caches of other kinds (``peers``: transformers' ``QuantizedCache``, say) are written by the
same forward where, as ``QuantizedCache`` does, their prefill hands back the keys and values
it was given, so that forward is theirs too.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from transformers.cache_utils import (Cache, CacheLayerMixin, DynamicCache,
                                      LinearAttentionCacheLayerMixin)

from lorc_fx.analysis.cache_probe import own_cache_class
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache import LatentCache, angles_handed
from lorc_fx.cache.layers import PREFILL_TOKENS
from lorc_fx.data.retrieval_tasks import NEW_TOKENS
from lorc_fx.plan.planner import Plan

FULL = "full cache"


def prompt_length(model: nn.Module, wanted: int) -> int | None:
    """Tokens of a retrieval prompt and its answer for ``model``: ``wanted``, or its context
    limit where shorter; ``None`` where that cannot hold, four times over, a prompt of more
    than ``PREFILL_TOKENS`` tokens and its answer."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    length = wanted if limit is None else min(wanted, limit)
    return length if length > 4 * (PREFILL_TOKENS + NEW_TOKENS) else None


class _PrefillTee(DynamicCache):
    """A plain cache whose writes are also written to ``latents`` (each a plan's fresh latent
    cache) and ``peers`` (fresh caches of other kinds): one prefill fills them all.
    ``angles_handed`` reaches the ``latents`` through the tee."""

    def __init__(self, config, latents: list[LatentCache], peers: list[Cache]):
        super().__init__(config=config)
        self.latents, self.peers = latents, peers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        for written in (*self.latents, *self.peers):
            written.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class SideBySide(Cache):
    """Caches of one row each, holding the same tokens, read as one cache whose row ``i`` is
    ``caches[i]``: each row's write of keys and values goes to its own cache, which hands back
    what it reads, so one forward reads them all as each alone would, the weights read once
    rather than once a cache. What the model asks before writing (sequence length, mask
    sizes) is the first cache's layers', every cache's alike. A linear-attention layer's
    convolution and recurrent states (a hybrid model's) are the first cache's, copied to
    every row, each row's written in place from then on: the rows differ in their keys and
    values alone until read. ``angles_handed`` reaches the latent caches among them
    (``latents``)."""

    def __init__(self, caches: list[Cache]):
        rows = torch.zeros(len(caches), dtype=torch.long)
        super().__init__(layers=[_one_a_row(layer, rows) for layer in caches[0].layers])
        self.caches = caches
        self.latents = [c for c in caches if isinstance(c, LatentCache)]

    def _refused(self, *args, **kwargs):
        raise TypeError("SideBySide only writes keys and values, each row to its own cache, "
                        "and linear-attention states: crop, reorder or reset the caches "
                        "themselves")

    # what would act on the first cache's layers alone (``self.layers``) or write another state
    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = reset = _refused
    update_indexer = _refused

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        read = [c.update(key_states[i:i + 1], value_states[i:i + 1], layer_idx, *args, **kwargs)
                for i, c in enumerate(self.caches)]
        return torch.cat([k for k, _ in read]), torch.cat([v for _, v in read])


def _one_a_row(layer, rows: torch.Tensor):
    """A linear-attention ``layer``'s copy with its states' first row at each of ``rows``
    (``SideBySide``'s own); any other layer as it is."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return layer
    copied = copy.deepcopy(layer)
    copied.reorder_cache(rows)
    return copied


def reads_side_by_side(model: nn.Module) -> bool:
    """Whether ``SideBySide`` can read ``model``'s caches: transformers' ``DynamicCache`` (not
    a class of the model's own) whose every layer holds keys and values or linear-attention
    states, not both (one copy would not follow the rows' keys) and no indexer's keys (which
    it does not split by row)."""
    if own_cache_class(model) is not None:
        return False
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    return not any((isinstance(layer, LinearAttentionCacheLayerMixin)
                    and isinstance(layer, CacheLayerMixin))
                   or hasattr(layer, "update_indexer") for layer in cache.layers)


Prefilled = list[tuple[str, object, Plan | None]]  # (name, cache, plan), the full cache first


def prefilled(model: nn.Module, input_ids: list[int], plans: dict[str, Plan],
              blocks: list[AttentionBlock], peers: dict[str, Callable[[], Cache]] | None = None
              ) -> tuple[torch.Tensor, Prefilled]:
    """The last logits of one forward of ``input_ids``, and the caches it wrote: the full
    cache (``FULL``, plan ``None``), each plan's latent cache, then each of ``peers``' (a
    fresh cache by name, plan ``None``), by name."""
    if len(input_ids) <= PREFILL_TOKENS:
        raise ValueError(f"one prefill serves every cache only for prompts of more than "
                         f"{PREFILL_TOKENS} tokens (a latent cache reads a shorter one back as "
                         f"stored), not {len(input_ids)}")
    config = model.config.get_text_config(decoder=True)
    ids = torch.tensor([input_ids], device=next(model.parameters()).device)
    peer_caches = {name: fresh() for name, fresh in (peers or {}).items()}
    tee = _PrefillTee(config, [LatentCache.from_cache(DynamicCache(config=config), p)
                               for p in plans.values()], list(peer_caches.values()))
    with angles_handed(model, blocks, *plans.values()):
        logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=tee,
                       use_cache=True).logits[:, -1]
    caches = dict(zip(plans, tee.latents))
    tee.latents, tee.peers = [], []  # the tee reads on as the full cache
    return logits, [(FULL, tee, None), *((n, caches[n], p) for n, p in plans.items()),
                    *((n, cache, None) for n, cache in peer_caches.items())]


@contextmanager
def side_by_side(model: nn.Module, input_ids: list[int], plans: dict[str, Plan],
                 blocks: list[AttentionBlock], peers: dict[str, Callable[[], Cache]] | None = None):
    """One prefill of ``input_ids`` (:func:`prefilled`), then its caches, the full cache's
    first, each plan's and each peer's after, read as one (``SideBySide``) with every plan's
    RoPE angles handed: yields the prefill's last logits, one row a cache, and that cache."""
    logits, caches = prefilled(model, input_ids, plans, blocks, peers)
    with angles_handed(model, blocks, *plans.values()):
        yield logits.expand(len(caches), -1), SideBySide([cache for _, cache, _ in caches])


def step(model: nn.Module, tokens: torch.Tensor, cache, length: int) -> torch.Tensor:
    """The logits of every one of ``tokens`` (``(b, t)``) written to ``cache``, which then
    holds ``length`` tokens: ``(b, t, vocab)``."""
    mask = torch.ones(len(tokens), length, dtype=torch.long, device=tokens.device)
    return model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True).logits


@torch.no_grad()
def answer_logprobs(model: nn.Module, prompts: list[tuple[list[int], list[int]]],
                    plans: dict[str, Plan], blocks: list[AttentionBlock]
                    ) -> dict[str, list[float]]:
    """Per ``(prompt ids, answer ids)`` the log-probability (nats) of the answer after the
    prompt through the full cache (``FULL``) and each plan's, one prefill a prompt for all.
    The answer's first token is scored by the prefill (the full model's for every cache);
    the others by one forward of the answer through every cache side by side (its tokens
    read back as stored, as decode steps read them). A graded score where accuracy is a coin:
    it moves with a cache's errors before they flip an answer."""
    out: dict[str, list[float]] = {name: [] for name in [FULL, *plans]}
    for prompt, answer in prompts:  # one prompt's caches at a time, freed before the next
        for name, total in zip(out, _answer_logprobs(model, prompt, answer, plans, blocks),
                               strict=True):
            out[name].append(total)
    return out


def _answer_logprobs(model: nn.Module, prompt: list[int], answer: list[int],
                     plans: dict[str, Plan], blocks: list[AttentionBlock]) -> list[float]:
    """The answer's log-probability through the full cache, then each plan's."""
    with side_by_side(model, prompt, plans, blocks) as (logits, cache):
        first = float(logits[0].float().log_softmax(-1)[answer[0]])
        if len(answer) == 1:
            return [first] * len(logits)
        rest = torch.tensor([answer[:-1]], device=logits.device).expand(len(logits), -1)
        targets = torch.tensor(answer[1:], device=logits.device)
        read = step(model, rest, cache, len(prompt) + len(answer) - 1)
    scored = read.float().log_softmax(-1)[:, torch.arange(len(targets)), targets]
    return (first + scored.sum(-1)).tolist()
