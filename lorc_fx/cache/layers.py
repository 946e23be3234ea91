"""Cache layers that hold low-rank latents (or codes of them, or of the keys and values
themselves) instead of keys and values: one class per allocation, dynamic or static, each
side held by the store its code asks for (``stores``).

``update()`` stores ``P·k`` and ``P·v`` and returns their reconstructions ``Pᵀ·c``, so a
model's own attention code runs unchanged in eager mode and Python keeps owning the
cache's shapes (docs/design.md, "Who owns the cache"). The compiled path rewrites the
reconstruction away.

A prefill (a write of more than ``PREFILL_TOKENS`` tokens) attends the tokens it writes as it
computed them, the earlier ones as stored (``_PrefillAsComputed``); every later step reads
all of them as stored.

Keys of a ``reconstruct``-mode layer are cached before RoPE (the paper's joint basis): the
layer turns the incoming post-RoPE keys back, and rotates the rebuilt keys again at every
step with the angles of their own positions, kept once per cache in a ``RotaryLog``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                     StaticSlidingWindowLayer)
from transformers.utils import is_torchdynamo_compiling

from lorc_fx.plan.planner import Code, LayerPlan

from .latent_ops import project, reconstruct, rotated_reconstruct
from .rotary import RotaryLog, frequency_pairs, rotate
from .stores import dynamic_store, settle_group, static_store


# a write of more tokens than this is a prefill (a prompt, a long chunk); shorter ones (decode
# steps, draft verification) read every token as stored, as the compiled decode graphs do
# (``compile.passes.absorb_latent_attention``)
PREFILL_TOKENS = 32


@dataclass
class LatentCodec:
    """One layer's bases, ``(r, h_kv*d)`` each; ``None`` keeps that side full width.

    Latents are ``basis·k``, rebuilt as ``rebuildᵀ·latent`` (``rebuild`` defaults to the
    basis: orthonormal rows). ``rope_style`` is set for keys cached before RoPE
    (``reconstruct`` mode); the cache then hands the layer its shared ``rotary`` log.
    """

    k_basis: torch.Tensor | None
    v_basis: torch.Tensor | None
    num_kv_heads: int
    rope_style: str | None = None
    rotary: RotaryLog | None = None
    k_rebuild: torch.Tensor | None = None
    v_rebuild: torch.Tensor | None = None
    rotary_dim: int = 0  # head dims RoPE turns, where ``rope_style`` is set
    rope_turn: int = 1  # -1: the model turns its pairs by -θ (``RopeLayout.turn``)
    # each key rebuild row's rotary pair, where every row lies on one (``rotary.frequency_pairs``)
    k_pairs: tuple[int, ...] | None = None

    @classmethod
    def of(cls, layer: LayerPlan) -> "LatentCodec":
        """The codec of a planned layer; a side the plan cannot compress (keys behind a
        norm) is stored raw. A layer at full rank still stores latents (an orthonormal change
        of basis), so a plan at fraction 1.0 runs the whole latent path."""
        pre_rope = layer.k_latent_of == "pre_rope" and layer.k_compressible
        return cls(layer.k_basis if layer.k_compressible else None,
                   layer.v_basis if layer.v_compressible else None, layer.num_kv_heads,
                   layer.rope.style if layer.k_latent_of == "pre_rope" else None,
                   k_rebuild=layer.k_rebuild if layer.k_compressible else None,
                   v_rebuild=layer.v_rebuild if layer.v_compressible else None,
                   rotary_dim=layer.rope.rotary_dim, rope_turn=layer.rope.turn,
                   k_pairs=frequency_pairs(layer.k_rebuild, layer.num_kv_heads,
                                           layer.rope.rotary_dim, layer.rope.style)
                   if pre_rope else None)

    def __post_init__(self):
        self.k_rebuild = self.k_basis if self.k_rebuild is None else self.k_rebuild
        self.v_rebuild = self.v_basis if self.v_rebuild is None else self.v_rebuild

    def to(self, like: torch.Tensor) -> "LatentCodec":
        cast = lambda b: None if b is None else b.to(device=like.device, dtype=like.dtype)
        return replace(self, k_basis=cast(self.k_basis), v_basis=cast(self.v_basis),
                       k_rebuild=cast(self.k_rebuild), v_rebuild=cast(self.v_rebuild))

    def compress(self, keys: torch.Tensor, values: torch.Tensor):
        if self.rotary is not None and self.k_basis is not None:
            cos, sin = self.rotary.incoming()
            power = cos * cos + sin * sin  # m² of tables scaled by m (YaRN): undone, not doubled
            keys = rotate(keys, cos / power, sin / power, self.rotary.style, inverse=True)
        k = keys if self.k_basis is None else project(keys, self.k_basis)
        v = values if self.v_basis is None else project(values, self.v_basis)
        return k, v

    def expand(self, keys: torch.Tensor, values: torch.Tensor):
        if self.k_basis is None:
            k = keys
        elif self.rotary is None:
            k = reconstruct(keys, self.k_rebuild, self.num_kv_heads)
        else:
            k = rotated_reconstruct(keys, self.k_rebuild, self.num_kv_heads,
                                    *self.rotary.angles(keys.shape[-2]), self.rotary.style,
                                    self.k_pairs)
        v = values if self.v_basis is None else reconstruct(values, self.v_rebuild, self.num_kv_heads)
        return k, v


class _RotaryLogOwner:
    """Policy of the layer that appends to its cache's ``RotaryLog``: every operation
    ``generate`` applies to cached tokens (cropping rejected drafts, reordering beams,
    repeating or selecting batch rows, resetting) is applied to the logged angles too, so a
    rebuilt key is always rotated by the angle of its own position."""

    bases: LatentCodec
    logs_rotary: bool

    def _log(self) -> RotaryLog | None:
        return self.bases.rotary if self.logs_rotary else None


class _PrefillAsComputed:
    """Policy of every latent layer: a prefill (a write of more than ``PREFILL_TOKENS``
    tokens) attends the tokens it writes as it computed them and the earlier ones as stored,
    as transformers' ``QuantizedCache`` and KIVI do. The cache stores them as the plan says
    and every later step reads them so; only the forward that computed them sees them exact,
    which costs nothing (they are in hand) and keeps the codes' rounding from compounding
    through the layers over the whole prompt (the default model at 4.5 bits per value,
    passkeys in 1k tokens: 19 of 50 found read back, 42 as computed, as many as the full
    cache: bench/results/retrieval_passkey50-cpu.md).

    ``prefill_as_stored`` (``LatentCache.from_cache(..., prefill_as_stored=True)``) reads them
    back through the codes instead: what one-forward measurements use to stand for the
    decode steps, which read every token as stored (the planner's held-out loss)."""

    prefill_as_stored = False

    def _as_computed(self, incoming: int) -> bool:
        return not self.prefill_as_stored and incoming > PREFILL_TOKENS

    def _expanded(self, k: torch.Tensor, v: torch.Tensor, key_states, value_states):
        """Keys and values of the latents ``k``, ``v`` (their last tokens the incoming
        ``key_states``/``value_states``) as attention reads them: rebuilt, or, in a prefill,
        the incoming ones as they came after the earlier ones rebuilt."""
        incoming = key_states.shape[-2]
        if not self._as_computed(incoming):
            return self.bases.expand(k, v)
        earlier = k.shape[-2] - incoming
        if earlier == 0:
            return key_states, value_states
        return self._stored_then_incoming(k[..., :earlier, :], v[..., :earlier, :],
                                          key_states, value_states)

    def _stored_then_incoming(self, k, v, key_states, value_states):
        """The earlier tokens' latents ``k``, ``v`` rebuilt, then the incoming keys and values
        as they came."""
        k, v = self.bases.expand(k, v)
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)


class _FixedAddresses:
    """Policy of a static latent layer: its buffers keep the fixed addresses a compiled step
    was traced with, so it refuses offloading."""

    def offload(self):
        raise NotImplementedError("offloading a static latent layer is not supported: its "
                                  "buffers keep fixed addresses")

    def prefetch(self):
        raise NotImplementedError("offloading a static latent layer is not supported: its "
                                  "buffers keep fixed addresses")


class _SinksPlaced:
    """Policy of a layer holding a store per side: where each row's first token sits is
    handed to both stores (what a store that keeps sinks keeps as it came)."""

    def place_sinks(self, positions: torch.Tensor) -> None:
        """Where each row's first token sits ``(b,)`` (after its left padding), before the
        first update."""
        self.k_store.place_sinks(positions)
        self.v_store.place_sinks(positions)


class LatentDynamicLayer(_PrefillAsComputed, _SinksPlaced, _RotaryLogOwner, DynamicLayer):
    """A growing cache of one layer: each side's window in ``keys`` / ``values`` (latents
    ``(b, 1, n, r)``: the head axis keeps the seq axis at -2, so masks and
    ``get_seq_length`` work as for full keys), the rest in the store of its code
    (``k_store`` / ``v_store``). Every batch operation ``generate`` applies (cropping
    rejected drafts, reordering beams, repeating or selecting rows, offloading) reaches the
    windows, the stores and the RoPE angle log alike."""

    def __init__(self, bases: LatentCodec, k_code: Code = None, v_code: Code = None,
                 logs_rotary: bool = False):
        super().__init__()
        self.bases, self.logs_rotary, self.codes = bases, logs_rotary, (k_code, v_code)
        self._new_stores()

    def _new_stores(self) -> None:
        group = settle_group(self.codes)
        self.k_store, self.v_store = (dynamic_store(code, group) for code in self.codes)

    def lazy_initialization(self, key_states, value_states):
        self.bases = self.bases.to(key_states)
        super().lazy_initialization(key_states, value_states)

    def get_seq_length(self) -> int:
        """Tokens cached, read off the keys' store (a plan may keep a zero-wide latent)."""
        return self.k_store.tokens(self.keys) if self.is_initialized else 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            self.bases.rotary.append(None)
        k, v = self.bases.compress(key_states, value_states)
        self.keys = self.k_store.append(self.keys, k)
        self.values = self.v_store.append(self.values, v)
        return self._expanded(*self.latents(), key_states, value_states)

    def mark_dynamic(self) -> None:
        """Mark the axes that grow with the tokens (the windows' rows, the codes' groups)
        dynamic before a compiled step reads them. Dynamo would otherwise trace the first
        decode step with every such length fixed and compile again as each starts to change
        (the windows' rows at the next step, the codes' groups a group later): one decode
        graph instead of three, each minutes of Inductor on the default model. Eager: no
        effect."""
        if self.is_initialized:
            for tensor, dim in (*self.k_store.token_axes(self.keys),
                                *self.v_store.token_axes(self.values)):
                if tensor.shape[dim] > 1:  # 0 and 1 are specialised whatever is marked
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached token's latents (or keys and values) as attention reads them,
        before the rebuild: what ``update`` expands."""
        return self.k_store.read(self.keys), self.v_store.read(self.values)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds, as far as it holds tokens (the RoPE angle log is
        the cache's)."""
        if not self.is_initialized:
            return []
        return [*self.k_store.tensors(self.keys), *self.v_store.tensors(self.values)]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not "
                             "supported: pass a negative number of tokens to remove")
        length = self.get_seq_length()
        if tokens_to_remove == 0 or length == 0:
            return
        keep = max(length + tokens_to_remove, 0)
        self.keys = self.k_store.cut(self.keys, keep)
        self.values = self.v_store.cut(self.values, keep)
        if self._log() is not None:
            self._log().crop(tokens_to_remove)

    def _map_batch(self, fn) -> None:
        """``fn``, an operation on the batch axis 0, on every per-row tensor: windows, stores
        and the RoPE angle log."""
        if self.get_seq_length() > 0:
            self.keys, self.values = fn(self.keys), fn(self.values)
        self.k_store.map_batch(fn)
        self.v_store.map_batch(fn)
        if self._log() is not None:
            self._log().map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    def offload(self):
        """The windows and stores to the CPU (the RoPE angle log, shared by the cache's
        layers, stays)."""
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self):
        if self.is_initialized and self.keys.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        move = lambda t: t.to(device, non_blocking=True)
        self.keys, self.values = move(self.keys), move(self.values)
        self.k_store.map_batch(move)
        self.v_store.map_batch(move)

    def reset(self) -> None:
        super().reset()
        self._new_stores()
        if self._log() is not None:
            self._log().reset()


class LatentSlidingLayer(LatentDynamicLayer, DynamicSlidingWindowLayer):
    """A sliding-window (or chunked) layer over stores: transformers'
    ``DynamicSlidingWindowLayer`` semantics, each side held by the store of its code.

    As transformers' layer, ``update`` returns the tokens kept before it (at most the last
    ``sliding_window - 1``) followed by every new token (a prefill longer than the window
    included), then keeps the last ``sliding_window - 1`` tokens; ``get_seq_length`` is every
    token seen (``cumulative_length``) and ``get_mask_sizes`` is transformers'. Codes are
    dropped in whole groups only (never re-quantized), so the layer may hold up to G - 1
    tokens more than the window as codes; what is returned is always exactly the window.
    ``activate_past_recording`` and ``crop`` work as transformers' do. Keys cached before
    RoPE are not supported here (the RoPE angle log is the whole cache's)."""

    is_sliding = True

    def __init__(self, sliding_window: int, bases: LatentCodec, k_code: Code = None,
                 v_code: Code = None):
        if bases.rope_style is not None:
            raise ValueError("a sliding-window layer cannot cache keys before RoPE")
        DynamicSlidingWindowLayer.__init__(self, sliding_window)
        self.bases, self.logs_rotary, self.codes = bases, False, (k_code, v_code)
        self._new_stores()

    def held(self) -> int:
        """Tokens the stores hold (the window, and up to G - 1 older ones in codes)."""
        return self.k_store.tokens(self.keys) if self.is_initialized else 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        shown = min(self.held(), self.sliding_window - 1) + key_states.shape[-2]
        self.cumulative_length += key_states.shape[-2]
        k, v = self.bases.compress(key_states, value_states)
        self.keys = self.k_store.append(self.keys, k)
        self.values = self.v_store.append(self.values, v)
        k, v = self.latents()
        if k.shape[-2] > shown:
            k, v = k[..., -shown:, :], v[..., -shown:, :]
        if not self.record_past:
            self._slide(0)
        return self._expanded(k, v, key_states, value_states)

    def _slide(self, removed: int) -> None:
        """Drop the ``removed`` newest tokens, then the oldest beyond the last
        ``sliding_window - 1`` (as many as both stores can: whole groups of codes)."""
        if removed:
            keep = self.held() - removed
            self.keys = self.k_store.cut(self.keys, keep)
            self.values = self.v_store.cut(self.values, keep)
        excess = self.held() - (self.sliding_window - 1)
        if excess > 0:
            tokens = min(self.k_store.droppable(self.keys, excess),
                         self.v_store.droppable(self.values, excess))
            self.keys = self.k_store.drop(self.keys, tokens)
            self.values = self.v_store.drop(self.values, tokens)

    def crop(self, tokens_to_remove: int) -> None:
        """As ``DynamicSlidingWindowLayer.crop``: below the window, that of a full layer; at or
        beyond it, only with past recording on, ``-n`` removing the ``n`` newest tokens and
        ``0`` restricting the layer back to its window."""
        if self.get_seq_length() < self.sliding_window:
            LatentDynamicLayer.crop(self, tokens_to_remove)
            self.cumulative_length = self.held()
            return
        if not self.record_past:
            raise RuntimeError("`crop` was called, but the current layer does not track past "
                               "states, and the sliding window size was already reached. Call "
                               "`activate_past_recording` before `crop` to be able to rollback "
                               "the cache.")
        if tokens_to_remove > 0:
            raise RuntimeError("Once the sliding window size has been reached, a sliding layer "
                               "can only be cropped by passing a negative int, to specify how "
                               "many tokens to remove")
        self._slide(-tokens_to_remove)
        self.cumulative_length -= -tokens_to_remove


class LatentStaticLayer(_PrefillAsComputed, _SinksPlaced, _FixedAddresses, _RotaryLogOwner,
                        StaticLayer):
    """A preallocated cache of one layer for ``max_cache_len`` tokens: each side's window
    (the whole buffer of an uncoded side) in ``keys`` / ``values``, its codes in the store of
    its code, written in place at the cache positions (``cumulative_length`` on), so a
    compiled decode step traces once for every position. Beams permute every buffer in
    place, keeping the fixed addresses; a static layer has no ``crop`` nor batch
    repeat/select."""

    def __init__(self, max_cache_len: int, bases: LatentCodec, k_code: Code = None,
                 v_code: Code = None, logs_rotary: bool = False):
        super().__init__(max_cache_len)
        self.bases, self.logs_rotary = bases, logs_rotary
        self.k_store, self.v_store = static_store(k_code), static_store(v_code)

    def lazy_initialization(self, key_states, value_states):
        """Allocate the buffers and give them fixed addresses, as ``StaticLayer`` does (not
        while dynamo traces)."""
        self.bases = self.bases.to(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.k_store.allocate(key_states, self.bases.k_basis, self.max_cache_len)
        self.values = self.v_store.allocate(value_states, self.bases.v_basis, self.max_cache_len)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            for tensor in (*self.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the layer holds: windows, packed codes, scales, zero points (the
        RoPE angle log is the cache's)."""
        return [self.keys, self.values, *self.k_store.tensors(), *self.v_store.tensors()]

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides over all ``max_cache_len`` tokens, a coded one decoded: what ``update``
        rebuilds."""
        return self.k_store.read(self.keys), self.v_store.read(self.values)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new tokens at ``cumulative_length`` on (any number, within
        ``max_cache_len``) and return K/V rebuilt from every allocated position."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tokens = key_states.shape[-2]
        positions = torch.arange(tokens, device=self.device) + self.cumulative_length
        if self.logs_rotary:
            self.bases.rotary.append(positions)
        k, v = self.bases.compress(key_states, value_states)
        self.k_store.write(self.keys, k, positions, self.cumulative_length)
        self.v_store.write(self.values, v, positions, self.cumulative_length)
        self.cumulative_length.add_(tokens)
        k, v = self.bases.expand(*self.latents())
        if self._as_computed(tokens):  # a prefill: its own tokens as they came
            k, v = k.index_copy(2, positions, key_states), v.index_copy(2, positions, value_states)
        return k, v

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for t in self.tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self._log() is not None:
            self._log().map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        super().reset()
        for t in self.tensors() if self.is_initialized else ():
            t.zero_()
        if self._log() is not None:
            self._log().reset()


class LatentStaticSlidingLayer(_PrefillAsComputed, _FixedAddresses, StaticSlidingWindowLayer):
    """A static sliding-window (or chunked) layer over stores: transformers'
    ``StaticSlidingWindowLayer`` semantics (``get_seq_length``, ``get_mask_sizes``, what
    ``update`` returns), each side held by the static store of its code in a **ring buffer**
    of ``ring`` token slots, token ``p`` at slot ``p mod ring``: the window ``W`` (the
    layer's ``max_cache_len``: the sliding window, or fewer) rounded up to whole groups of G,
    plus two groups, so a write of at most ``W + G - 1`` tokens (the groups it stages
    included) never reaches a slot a token of the window still holds.

    What ``update`` returns, as transformers' layer: while the window is not yet full, its
    ``W`` slots in order (positions past the length are masked), as stored; a single token
    into a full window, the last ``W`` tokens in order, as stored; more tokens than fit
    (a prefill or continuation past the window), the window's last tokens as stored followed
    by the new tokens as they came (at most ``PREFILL_TOKENS`` of them: as stored, as the dynamic
    layer returns them). A prefill longer than the window writes only what it will keep (from
    a whole group on). Keys cached before RoPE are not supported here."""

    def __init__(self, max_cache_len: int, sliding_window: int, bases: LatentCodec,
                 k_code: Code = None, v_code: Code = None):
        if bases.rope_style is not None:
            raise ValueError("a sliding-window layer cannot cache keys before RoPE")
        super().__init__(max_cache_len, sliding_window)
        self.bases = bases
        self.k_store, self.v_store = static_store(k_code), static_store(v_code)
        self.group = settle_group((k_code, v_code))
        self.ring = (-(-self.max_cache_len // self.group) + 2) * self.group
        self.position = torch.tensor(0, dtype=torch.long)  # tokens written, as a tensor

    def lazy_initialization(self, key_states, value_states):
        self.bases = self.bases.to(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = self.k_store.allocate(key_states, self.bases.k_basis, self.ring, ring=True)
        self.values = self.v_store.allocate(value_states, self.bases.v_basis, self.ring, ring=True)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.position = self.position.to(self.device)
        if not is_torchdynamo_compiling():
            for tensor in (*self.tensors(), self.cumulative_length, self.position):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the layer holds: windows (a full side's whole ring), packed codes,
        scales, zero points."""
        return [self.keys, self.values, *self.k_store.tensors(), *self.v_store.tensors()]

    def _ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides over the ring's slots, decoded."""
        return self.k_store.read(self.keys), self.v_store.read(self.values)

    def _in_order(self, sides, first: torch.Tensor, count: int):
        """``count`` tokens from position ``first`` (a tensor) on, in order, of ring ``sides``."""
        index = (torch.arange(count, device=self.device) + first) % self.ring
        return tuple(side.index_select(2, index) for side in sides)

    def _write(self, k: torch.Tensor, v: torch.Tensor, read_back: bool = False):
        """Write ``k``, ``v`` at ``position`` on; with ``read_back``, G tokens at a time, and
        return them as stored (each piece read while the ring still holds it).

        Without it, in one write a side (a compiled prefill's graph holds one write a layer,
        not one per group of its window): the callers write at most ``W + G - 1`` tokens, whose
        groups and the one a write stages past them, at most ``W / G + 2``, fit in the ring,
        and the groups they reach are the written tokens' own or past the oldest the window
        keeps."""
        stored, step = [], self.group if read_back else max(k.shape[-2], 1)
        for at in range(0, k.shape[-2], step):
            chunk_k, chunk_v = k[..., at:at + step, :], v[..., at:at + step, :]
            positions = torch.arange(chunk_k.shape[-2], device=self.device) + self.position
            self.k_store.write(self.keys, chunk_k, positions % self.ring, self.position)
            self.v_store.write(self.values, chunk_v, positions % self.ring, self.position)
            if read_back:
                stored.append(self._in_order(self._ring(), self.position, chunk_k.shape[-2]))
            self.position.add_(chunk_k.shape[-2])
        return stored

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tokens, current = key_states.shape[-2], self.cumulative_length_int
        window = self.max_cache_len
        self.cumulative_length_int += tokens
        k, v = self.bases.compress(key_states, value_states)
        if current + tokens <= window or (current >= window and tokens == 1):
            self._write(k, v)
            if current + tokens > window:
                return self.bases.expand(*self._in_order(self._ring(), self.position - window,
                                                         window))
            self.cumulative_length.add_(tokens)
            k, v = self.bases.expand(*(side.narrow(2, 0, window) for side in self._ring()))
            if self._as_computed(tokens):  # a prefill: its own tokens as they came
                k = k.slice_scatter(key_states, dim=2, start=current, end=current + tokens)
                v = v.slice_scatter(value_states, dim=2, start=current, end=current + tokens)
            return k, v
        # more than the window holds: its last tokens as stored, then the new ones as they came
        # (a prefill) or as stored (a few tokens: a continuation, as the dynamic layer)
        kept = min(current, window - 1)
        old = self._in_order(self._ring(), self.position - kept, kept)
        if not self._as_computed(tokens):
            new = self._write(k, v, read_back=True)
            return self.bases.expand(*(torch.cat(side, dim=-2) for side in zip(old, *new)))
        skip = max(0, (current + tokens - window) // self.group * self.group - current)
        if skip:  # tokens that leave the window at once: written from a whole group on
            self.position.add_(skip)
        self._write(k[..., skip:, :], v[..., skip:, :])
        return self._stored_then_incoming(*old, key_states, value_states)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for t in self.tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def reset(self) -> None:
        super().reset()
        for t in self.tensors() if self.is_initialized else ():
            t.zero_()
        self.position.zero_()
