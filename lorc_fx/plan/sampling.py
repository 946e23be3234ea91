"""Text sampled from the model itself: calibration that needs no corpus and no tokenizer.

Every sequence starts from the model's BOS token (else EOS) and continues by plain
temperature sampling within the nucleus ``top_p`` (``SAMPLING``), decoding with the model's
own KV cache. Each sequence draws its random numbers from its own generator, seeded by the
caller, so a sequence does not depend on which others are sampled beside it or how many;
``lorc_fx.plan.calibration`` keeps them on disk.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from lorc_fx.analysis.cache_probe import fresh_cache

# what the samples depend on besides the model and the seeds: part of their cache key
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "version": 1}
# candidates looked at before sorting the whole vocabulary, in tiers: a top-k of a few
# hundred holds the nucleus of most steps and costs a fraction of a full sort
_NUCLEUS_CANDIDATES = (512, 4096)


def start_token(model: nn.Module, tokenizer=None) -> int | None:
    """The token every sampled sequence starts from: BOS, else EOS, of the tokenizer, the
    generation config or the model config, in that order; where none names one, their CLS
    (a BERT-style model opens every text with it), else padding token; ``None`` where none
    has any."""
    sources = (tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None))
    for attrs in (("bos_token_id", "eos_token_id"), ("cls_token_id", "pad_token_id")):
        for source in sources:
            for attr in attrs:
                tid = getattr(source, attr, None)
                if isinstance(tid, (list, tuple)):
                    tid = tid[0] if tid else None
                if tid is not None:
                    return int(tid)
    return None


def nucleus_pick(probs: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """``(b, 1)`` token ids: for each row of ``probs`` (``(b, vocab)``), the token at quantile
    ``u`` of the nucleus, the most probable tokens up to and including the one whose
    cumulative probability reaches ``top_p``."""
    out = torch.empty(len(probs), 1, dtype=torch.long)
    rows = torch.arange(len(probs))
    for k in _NUCLEUS_CANDIDATES:
        if k >= probs.shape[-1] or not len(rows):
            break
        values, order = probs[rows].topk(k, dim=-1)
        # the nucleus ends within the candidates where their cumulative probability reaches
        # top_p (the very sums a full sort takes); the other rows go on to more candidates
        done = values.cumsum(-1)[:, -1] >= top_p
        out[rows[done]] = _pick_sorted(values[done], order[done], top_p, u[rows[done]])
        rows = rows[~done]
    if len(rows):
        values, order = probs[rows].sort(dim=-1, descending=True)
        out[rows] = _pick_sorted(values, order, top_p, u[rows])
    return out


def _pick_sorted(values: torch.Tensor, order: torch.Tensor, top_p: float,
                 u: torch.Tensor) -> torch.Tensor:
    kept = values * (values.cumsum(-1) - values < top_p)
    cdf = kept.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_max(cdf.shape[-1] - 1)
    return order.gather(-1, pick)


class _Preallocated(DynamicLayer):
    """A ``DynamicLayer`` that writes into buffers of ``capacity`` tokens and hands back views of
    the tokens written: the same keys and values, without the concatenation that copies the
    whole layer every step (13% of the time of sampling 40 sequences of 256 tokens from the
    default model)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys = key_states.new_empty(*key_states.shape[:-2], self.capacity,
                                          key_states.shape[-1])
        self._values = value_states.new_empty(*value_states.shape[:-2], self.capacity,
                                              value_states.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values


def sampling_cache(model: nn.Module, capacity: int):
    """A plain cache for ``model`` (``fresh_cache``) whose full-attention ``DynamicLayer`` s are
    ``_Preallocated`` for ``capacity`` tokens (other kinds of layers as they are)."""
    cache = fresh_cache(model)
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _Preallocated(capacity)
    return cache


@torch.no_grad()
def sample_sequences(model: nn.Module, start: int, length: int, seeds: list[int],
                     step: Callable[[int], None] | None = None) -> torch.Tensor:
    """``(len(seeds), length)`` token ids, ``start`` first, sequence ``i`` drawn with a
    generator seeded ``seeds[i]``; decoded with a plain cache (``sampling_cache``; also on a
    model whose ``generate`` was given a latent cache). ``step(n)`` is called after every
    decode step with the ``n`` tokens it produced (a progress bar's ``update``)."""
    device = next(model.parameters()).device
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    ids = torch.full((len(seeds), 1), start, dtype=torch.long)
    cache = sampling_cache(model, length)
    out = [ids]
    temperature, top_p = SAMPLING["temperature"], SAMPLING["top_p"]
    for _ in range(length - 1):
        logits = model(ids.to(device), past_key_values=cache, use_cache=True).logits[:, -1]
        scores = logits.double().cpu()
        probs = torch.softmax(scores if temperature == 1 else scores / temperature, dim=-1)
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens])
        ids = nucleus_pick(probs, top_p, u)
        out.append(ids)
        if step is not None:
            step(len(seeds))
    return torch.cat(out, dim=1)
