"""What one side (keys or values) of a latent cache layer holds, one store per code.

A layer (``cache.layers``: one class per allocation, dynamic or static) keeps each side's
full-precision part in ``keys`` / ``values`` (its *window*: every token of an uncoded side,
the tokens not yet coded of a coded one) and hands it to that side's store, which holds the
rest (codes, scales, sinks). The store is chosen by the side's code in the plan
(``plan.planner.Code``), whatever scheme chose it:

- a dynamic store has ``append(window, new) -> window``, ``read(window)`` (every token as
  attention reads it), ``tokens(window)``, ``cut(window, keep) -> window``, ``map_batch(fn)``
  (a batch operation on its per-row tensors: beams, repeat/select, offloading),
  ``tensors(window)`` and ``place_sinks(positions)`` (where each row's first token sits,
  after its left padding: what a store keeping sinks keeps as it came); the stores a
  sliding-window layer may hold (full and integer) also have ``droppable(window, tokens)`` and
  ``drop(window, tokens) -> window`` (the oldest tokens: whole groups of codes);
- a static store has ``allocate(states, basis, max_cache_len) -> window``,
  ``write(window, states, positions, start)`` (in place), ``read(window)``, ``tensors()``
  (its buffers besides the window) and ``place_sinks(positions)``.
"""
from __future__ import annotations

from lorc_fx.codes.integer import ChannelSplit, QuantSpec
from lorc_fx.codes.vector import VectorBook

from .full import FullStaticStore, FullStore
from .integer import IntegerStore
from .integer_static import IntegerStaticStore
from .vector import VectorStore
from .vector_static import VectorStaticStore


def settle_group(codes) -> int:
    """Tokens per settled group of a layer whose sides are stored as ``codes``: the largest
    per-channel group of its integer codes (per-token codes need none), so both sides always
    hold the same tokens in codes and in windows."""
    return max([c.group for c in codes if isinstance(c, (QuantSpec, ChannelSplit))
                and c.axis == -2], default=1)


def dynamic_store(code, group: int):
    """The dynamic store of a side stored as ``code`` in a layer settling ``group`` tokens at
    a time (:func:`settle_group`)."""
    if code is None:
        return FullStore()
    if isinstance(code, VectorBook):
        return VectorStore(code)
    return IntegerStore(code, group)


def static_store(code):
    """The static store of a side stored as ``code``."""
    if code is None:
        return FullStaticStore()
    if isinstance(code, VectorBook):
        return VectorStaticStore(code)
    return IntegerStaticStore(code)
