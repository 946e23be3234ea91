"""Latent layers for the cache layers transformers builds that hold keys and values beside
another state: the attention half of a hybrid layer (linear attention / Mamba / convolution
state and full or sliding attention in one layer: Zamba, Falcon-H1, Zaya, Inkling) and the
indexed layer of sparse-attention models (DeepSeek-V3.2, GLM-MoE-DSA: an indexer's keys).

Each is transformers' own class with the latent layer behind it, so ``isinstance`` checks
(``Cache.is_linear``, which picks the layer the masks are sized by; ``update_conv_state``;
``update_indexer``) see what they saw before. Only the keys and values change: the other
state is kept exactly as transformers keeps it."""
from __future__ import annotations

import torch
from transformers.cache_utils import (DynamicIndexedLayer, LinearAttentionAndFullAttentionLayer,
                                     LinearAttentionAndSlidingWindowAttentionLayer,
                                     LinearAttentionLayer)

from lorc_fx.codes import rows
from lorc_fx.plan.planner import Code

from .layers import LatentCodec, LatentDynamicLayer, LatentSlidingLayer


INDEXER_ROWS = rows.RowSpec(8, 64)  # how a coded layer holds its indexer's keys


class _BesideLinearState:
    """Policy of a latent layer sharing its cache layer with linear-attention state:
    transformers' hybrid classes dispatch each batch operation to both halves by name
    (``DynamicLayer.reorder_cache(self, ...)``), which would skip the latent half's stores,
    so every such operation is dispatched here to the latent class (``_latent``) instead."""

    _latent: type

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # keys and values, from ``update``
            self._latent.lazy_initialization(self, *args)
        else:  # conv or recurrent state, by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def offload(self):
        LinearAttentionLayer.offload(self)
        self._latent.offload(self)

    def prefetch(self):
        LinearAttentionLayer.prefetch(self)
        self._latent.prefetch(self)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self._latent.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._latent.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._latent.crop(self, tokens_to_remove)


class LatentHybridLayer(_BesideLinearState, LinearAttentionAndFullAttentionLayer,
                        LatentDynamicLayer):
    """Linear-attention state as transformers keeps it, keys and values as latents."""

    _latent = LatentDynamicLayer

    def __init__(self, bases: LatentCodec, k_code: Code = None, v_code: Code = None,
                 logs_rotary: bool = False, number_of_states: int = 1):
        LatentDynamicLayer.__init__(self, bases, k_code, v_code, logs_rotary)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


class LatentHybridSlidingLayer(_BesideLinearState, LinearAttentionAndSlidingWindowAttentionLayer,
                               LatentSlidingLayer):
    """Linear-attention state as transformers keeps it, the sliding window as latents."""

    _latent = LatentSlidingLayer

    def __init__(self, sliding_window: int, bases: LatentCodec, k_code: Code = None,
                 v_code: Code = None, number_of_states: int = 1):
        LatentSlidingLayer.__init__(self, sliding_window, bases, k_code, v_code)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)


class LatentIndexedLayer(DynamicIndexedLayer, LatentDynamicLayer):
    """The indexer's keys as transformers keeps them (``update_indexer``) — or, where the
    layer's keys are coded, as row codes (``INDEXER_ROWS``: 8 bits, a power-of-two scale per
    group of channels; DeepSeek-V3.2 itself keeps them in FP8) — and keys and values as
    latents. ``DynamicIndexedLayer``'s batch operations call ``super()`` for the keys and
    values, which reaches the latent layer, and act on ``indexer_keys`` whatever it holds:
    codes and exponents are one tensor (``rows.packed``)."""

    def __init__(self, bases: LatentCodec, k_code: Code = None, v_code: Code = None,
                 logs_rotary: bool = False):
        LatentDynamicLayer.__init__(self, bases, k_code, v_code, logs_rotary)
        self.indexer_keys = self.indexer_position_ids = None  # as DynamicIndexedLayer's
        self.is_indexer_initialized = False
        self.codes_indexer = k_code is not None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        if not (self.codes_indexer and indexer_key_states.is_floating_point()):
            return super().update_indexer(indexer_key_states)
        coded = rows.packed(rows.encode(indexer_key_states, INDEXER_ROWS))
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(indexer_key_states)
            self.indexer_keys = coded
        else:
            self.indexer_keys = torch.cat([self.indexer_keys, coded], dim=1)
        return rows.unpacked(self.indexer_keys, INDEXER_ROWS, indexer_key_states.shape[-1],
                             indexer_key_states.dtype).decode()

    def tensors(self) -> list[torch.Tensor]:
        """The latent layer's tensors and the indexer's keys (counted in the cache's bytes)."""
        indexer = [self.indexer_keys] if self.is_indexer_initialized else []
        return [*super().tensors(), *indexer]
