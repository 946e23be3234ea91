"""Decode attention over quantized cache sides that reads the packed codes.

A quantized cache layer hands attention each side (keys or values: latents, or a plain
plan's raw ``(b, h_kv, n, d)`` tensors) as ``cat([lorc::dequantize(codes), window])``, maybe
cut to its first ``tokens`` rows (a window with spare rows after its tokens). A *side* here is
the triple ``(codes, window, tokens)``: ``codes`` the arguments of ``lorc::dequantize``,
``(payload, scale, zero, bits, group, axis, length, width)``, or ``None`` for a side kept in
the model's dtype; ``window`` the full-precision rows after the codes' ``length`` tokens
``(b, h_kv, rows, width)`` or ``None``; ``tokens`` the side's token count, or ``None`` for
all of ``length + rows``. A static sliding layer's full ring is ``(codes, None, None,
order)``: every slot's codes, and the slot each of the window's tokens sits at.

Dequantizing first would write a full-precision copy of the cache every step and read it
back. Here the score and output reductions are broadcast products and sums over the
dequantization maths itself (unpack by shifts and masks, ``zero + code·scale``), so Inductor
fuses the unpacking into the reductions and reads only the codes, scales and zero points.
Scale and zero point are constant over a group, so both are factored out of the reduction
over the codes: a score is ``Σ_c (q_c·scale_c)·code_c + Σ_c q_c·zero_c`` (per channel the
products ``q·scale`` are per group, ``n / G`` times fewer than the codes).

A side stored as product vector codes (``lorc::vector_latents``' arguments, tagged
``VECTOR``) is read the same way by ``_VectorPositions``: scores by a table of the query's dot
products with the codewords, value sums decoding 8 slots at a time in the kernel
(``lorc::vector_scores`` / ``vector_sums``), each row's sink by its latent. A drift offset
(constant over a chunk of slots, ``cache.stores.drift``) adds the query's product with each
chunk's offset to that chunk's scores, and each chunk's weight times its offset to the sums.

Attention runs over a side's *positions*: the codes' slots, then the window's rows
(``_Positions``). Slots past ``length`` (a padded group, a cache's spare slots) and rows past
``tokens`` (a window's spare rows) hold no token: they are masked out of the softmax and weigh
nothing. The mask is gathered from tokens to positions; values laid out like the keys (one
layer's two sides) take the probabilities as they are, others gather them by token. Packed
codes unpack in order (``codes.integer.pack_bits``), so positions follow the tokens; with an
``order`` token ``i`` is at slot ``order[i]`` and the slots it does not name hold no token.

Layouts (``codes/integer.py``): per channel (``axis`` -2) the payload is ``(b, h, width, groups,
group·bits/8)`` along the tokens, scale/zero ``(b, h, width, groups)``; per token (-1) it is
``(b, h, tokens, groups, group·bits/8)`` along the channels (padded to whole groups). Keys are
read per channel (latents, and a plain plan's keys); values per channel (latents) or per
token (a plain plan's values). Widths of 8, 4 and 2 bits.

Scores are materialised ``(b, h, t, positions)``: for decode steps (a few query tokens), not
prefill. A query row whose every key is masked gets zeros, as SDPA's math backend gives.
Codes are read and reduced in float32 (the scales' dtype rounds nothing more); the output is
in the query's dtype.

Written for Inductor's C++ loops, as measured (docs/design.md, "what Inductor makes of the
decode loops"): long sums add chunks (``_sum``), what the code reductions read once per code
is stored first (``_stored``), and the softmax is written out so its sum is chunked too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lorc_fx.cache.stores import drift
from lorc_fx.cache.stores.vector_ops import in_ring, token_positions, vector_decode
from lorc_fx.codes.vector import BLOCK, layout_of
from lorc_fx.kernels import vector_reductions
from lorc_fx.kernels.code_reductions import native_applies

from lorc_fx.cache.rotary import per_pair
from .latent_attention import head_blocks, per_frequency_queries, pre_rope_scores, turned

FUSED_BITS = (8, 4, 2)  # code widths whose bytes unpack by shifts alone
KEY_AXES, VALUE_AXES = (-2,), (-2, -1)  # keys per channel; values per channel or per token
VECTOR = "vector"  # the tag of a vector-coded side (``positions``)
SUM_CHUNK = 256  # tokens a long sum adds up before adding up the chunks (``_sum``)


def quantized_latent_attention(query, k_side, v_side, k_basis, v_basis, num_kv_heads: int,
                               attn_mask=None, scale: float | None = None):
    """SDPA of a few query tokens ``(b, h, t, d)`` over post-RoPE latent sides (keys and
    values ``(b, 1, n, r)``, quantized or not), absorbed as ``latent_attention``: the query
    goes through the per-head blocks of ``k_basis``, attention runs once over the shared
    latent, the output comes back through ``v_basis``. Returns ``(b, h, t, d)``."""
    b, h, t, d = query.shape
    scale = d ** -0.5 if scale is None else scale
    keys, values = positions(k_side), positions(v_side)
    q_latent = torch.einsum("bhtd,hrd->bhtr", query, head_blocks(k_basis, num_kv_heads, h))
    scores = keys.scores(q_latent.reshape(b, 1, h * t, -1)).view(b, h, t, -1) * scale
    probs = keys.softmax(scores, attn_mask).view(b, 1, h * t, -1)
    out = values.sums(keys.weights_for(values, probs)).view(b, h, t, -1).to(query.dtype)
    return torch.einsum("bhtr,hrd->bhtd", out, head_blocks(v_basis, num_kv_heads, h))


def quantized_rotary_latent_attention(query, k_side, cos, sin, v_side, k_basis, v_basis,
                                      num_kv_heads: int, style: str, pairs=None, attn_mask=None,
                                      scale: float | None = None):
    """SDPA of a few query tokens ``(b, h, t, d)`` over a pre-RoPE key latent side rotated by
    ``cos``/``sin`` ``(b, n, rotary_dim)`` and a value latent side, as
    ``rotary_latent_attention``: the key latent dequantized (``r_k`` floats a token), scored
    per rotary pair where ``pairs`` is given, else rebuilt into keys once per kv head and
    scored against queries turned back by each position's angle (``pre_rope_scores``); values
    read absorbed from their codes. Returns ``(b, h, t, d)``."""
    b, h, t, d = query.shape
    keys, values = positions(k_side), positions(v_side)
    cos, sin = keys.spread(cos, 1), keys.spread(sin, 1)
    if pairs is not None and isinstance(keys, _VectorPositions) and keys.turns():
        ab = per_frequency_queries(query, k_basis, num_kv_heads, style, pairs, cos.shape[-1])
        scale = d ** -0.5 if scale is None else scale
        scores = keys.turned_scores(ab, cos, sin, style, pairs).view(b, h, t, -1) * scale
    else:
        scores = pre_rope_scores(query, keys.values(), cos, sin, k_basis, num_kv_heads, style,
                                 pairs, scale)
    probs = keys.softmax(scores, attn_mask).view(b, 1, h * t, -1)
    out = values.sums(keys.weights_for(values, probs)).view(b, h, t, -1).to(query.dtype)
    return torch.einsum("bhtr,hrd->bhtd", out, head_blocks(v_basis, num_kv_heads, h))


def quantized_kv_attention(query, k_side, v_side, attn_mask=None, scale: float | None = None):
    """SDPA of a few query tokens ``(b, h, t, d)`` over raw key and value sides ``(b, h_kv, n,
    d)`` (a plain quantized plan: no basis), query head ``i`` reading kv head
    ``i // (h / h_kv)``. Returns ``(b, h, t, d)``."""
    b, h, t, d = query.shape
    scale = d ** -0.5 if scale is None else scale
    keys, values = positions(k_side), positions(v_side)
    kv_heads = keys.heads
    grouped = query.reshape(b, kv_heads, h // kv_heads * t, d)  # the query heads of each kv head
    if _fused_applies(keys, values, attn_mask):
        out = torch.ops.lorc.code_attention(
            grouped, *keys.codes[:3], keys.codes[3], *values.codes[:3], values.codes[3],
            keys.window_rows(d), values.window_rows(d), keys.bias(attn_mask, b, t), scale)
        return out.view(b, h, t, d).to(query.dtype)
    scores = keys.scores(grouped).view(b, h, t, -1) * scale
    probs = keys.softmax(scores, attn_mask).view(b, kv_heads, h // kv_heads * t, -1)
    return values.sums(keys.weights_for(values, probs)).view(b, h, t, -1).to(query.dtype)


def quantized_scores(query, k_side):
    """Manual attention's ``q @ kᵀ`` (unscaled) of a few query tokens ``(b, h, t, w)`` over a
    key side read from its codes: raw keys ``(b, h_kv, n, w)``, query head ``i`` reading kv
    head ``i // (h / h_kv)``, or a latent ``(b, 1, n, w)``. Returns ``(b, h, t, n)`` over the
    side's tokens, as the product over the side dequantized gives."""
    b, h, t, _ = query.shape
    keys = positions(k_side)
    scores = keys.scores(query.reshape(b, keys.heads, h // keys.heads * t, -1))
    return scores.index_select(-1, keys.position_of_token()).view(b, h, t, -1).to(query.dtype)


def quantized_sums(probs, v_side):
    """Manual attention's ``p @ v`` of weights ``(b, h, t, n)`` over a value side's tokens read
    from its codes (raw or a latent, grouped as :func:`quantized_scores`): ``(b, h, t, w)``."""
    b, h, t, _ = probs.shape
    values = positions(v_side)
    weights = values.spread(probs.float(), -1)  # zero at positions holding no token
    out = values.sums(weights.reshape(b, values.heads, h // values.heads * t, -1))
    return out.view(b, h, t, -1).to(probs.dtype)


def quantized_latent_scores(query, k_side, k_basis, num_kv_heads: int):
    """``latent_scores`` over a latent key side read from its codes (:func:`quantized_scores`):
    the query through each head's block of ``k_basis``, then scored as rows of the latent's
    one head."""
    blocks = head_blocks(k_basis, num_kv_heads, query.shape[1])
    return quantized_scores(torch.einsum("bhtd,hrd->bhtr", query, blocks), k_side)


def quantized_latent_sums(probs, v_side, v_basis, num_kv_heads: int):
    """``latent_sums`` over a latent value side read from its codes (:func:`quantized_sums`),
    then out through each head's block of ``v_basis``."""
    blocks = head_blocks(v_basis, num_kv_heads, probs.shape[1])
    return torch.einsum("bhtr,hrd->bhtd", quantized_sums(probs, v_side), blocks.to(probs.dtype))


def _fused_applies(keys: "_Positions", values: "_Positions", attn_mask) -> bool:
    """Whether ``lorc::code_attention``'s C++ kernel runs a plain plan's decode attention: keys
    per channel and values per token in widths and groups it reads, each token at the same
    position on both sides (the values' slots may stop short of the keys' where no token lies
    past them and no window follows: a static layer's spare key group), under a mask shared
    by the heads."""
    if keys.codes is None or values.codes is None:
        return False
    (*_, k_bits, k_group, k_axis, _, _, _), (*_, v_bits, v_group, v_axis, _, _, _) = (
        keys.codes, values.codes)
    same_positions = keys.order is values.order and (keys.slots == values.slots or (
        keys.rows == 0 and keys.length <= values.slots <= keys.slots))
    return (k_axis == -2 and v_axis == -1 and same_positions
            and keys.length == values.length and keys.rows == values.rows
            and keys.tokens == values.tokens
            and (attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[1] == 1))
            and native_applies(keys.device, k_bits, k_group)
            and native_applies(values.device, v_bits, v_group))


def positions(side) -> "_Positions":
    """A side as ``_Positions``: ``(codes, window, tokens[, order])``, or a vector-coded side
    ``(VECTOR, payload, tables, window, coded, tokens, sink, sink_at[, means, chunk, ring_from,
    ring_to])``."""
    if side[0] == VECTOR:
        return _VectorPositions(*side[1:])
    return _Positions(*side)


class _Positions:
    """A side ``(codes, window, tokens[, order])`` and the order of its positions: the codes'
    slots as stored, then the window's rows. With ``order`` (a ring's codes, no window) token
    ``i`` sits at slot ``order[i]`` and the slots it does not name hold no token."""

    def __init__(self, codes, window, tokens, order=None):
        self.codes, self.window, self.order = codes, window, order
        self.length = 0 if codes is None else codes[6]
        self.rows = 0 if window is None else window.shape[-2]
        if order is not None:  # the window's tokens, each at the slot it names
            tokens = order.shape[0]
        self.tokens = self.length + self.rows if tokens is None else tokens
        anchor = window if codes is None else codes[0]
        self.heads, self.device = anchor.shape[1], anchor.device
        if codes is None:
            self.slots = 0
        else:  # per channel the payload's groups run along the tokens, per token its rows
            self.slots = codes[0].shape[3] * codes[4] if codes[5] == -2 else codes[0].shape[2]

    def held(self):
        """Whether each position holds a token ``(positions,)``."""
        if self.order is not None:
            held = torch.zeros(self.slots, dtype=torch.bool, device=self.device)
            return held.index_fill(0, self.order, True)
        slots = torch.arange(self.slots, device=self.device) < self.length
        rows = torch.arange(self.rows, device=self.device) < self.tokens - self.length
        return torch.cat([slots, rows])

    def spread(self, x, dim: int):
        """``x``, indexed by token along ``dim``, indexed by position (zeros where a position
        holds no token). Slices and a concatenation: no gather for a fused loop to do, and no
        piece as short as the window's tokens (which may be 0 or 1)."""
        dim %= x.dim()
        if self.order is not None:
            shape = list(x.shape)
            shape[dim] = self.slots
            return x.new_zeros(shape).index_copy(dim, self.order, x)
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, self.rows + self.length - self.tokens]
        parts = [F.pad(x, pad).narrow(dim, self.length, self.rows)]
        if self.codes is not None:
            spare = list(x.shape)
            spare[dim] = self.slots - self.length
            parts[:0] = [x.narrow(dim, 0, self.length), x.new_zeros(spare)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def token_of_position(self):
        """The token each position holds ``(positions,)`` (any token where it holds none)."""
        return self.spread(torch.arange(self.tokens, device=self.device), 0)

    def position_of_token(self):
        """Where each token ``0 .. tokens - 1`` sits among the positions ``(tokens,)``."""
        if self.order is not None:
            return self.order
        return token_positions(torch.arange(self.tokens, device=self.device), self.length,
                               self.slots, self.rows)

    def scores(self, q):
        """``q (b, hk, m, width)`` against every position: ``(b, hk, m, positions)``,
        unscaled."""
        parts = [] if self.codes is None else [_code_scores(q, *self.codes)]
        if self.window is not None:
            parts.append(q @ self.window.transpose(-1, -2).to(q.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def values(self):
        """The side dequantized in position order ``(b, hk, positions, width)``."""
        parts = [] if self.codes is None else [_code_values(*self.codes)]
        return torch.cat(parts + ([] if self.window is None else [self.window]), dim=-2)

    def window_rows(self, width: int):
        """The window's rows ``(b, hk, rows, width)`` in float32, none of them where there is
        no window."""
        if self.window is not None:
            return self.window.float()
        payload = self.codes[0]
        return payload.new_zeros(payload.shape[0], self.heads, 0, width, dtype=torch.float32)

    def bias(self, attn_mask, batch: int, t: int):
        """What the softmax adds to every query row's scores ``(batch, t, positions)``: 0
        where ``attn_mask`` (SDPA's, shared by the heads) attends, or its additive value, and
        -inf at positions holding no token."""
        held = self.held()
        if attn_mask is None:
            bias = torch.where(held, 0.0, float("-inf"))
        else:
            picked = self.spread(attn_mask, -1)[:, 0]
            bias = (torch.where(picked & held, 0.0, float("-inf")) if picked.dtype == torch.bool
                    else torch.where(held, picked.float(), float("-inf")))
        return bias.expand(batch, t, -1)

    def softmax(self, scores, attn_mask):
        """Softmax of ``scores (b, h, t, positions)`` under ``attn_mask`` (SDPA's, over the
        tokens: boolean, True attends, or added), positions holding no token masked out."""
        if attn_mask is not None:
            picked = self.spread(attn_mask, -1)
            scores = (scores.masked_fill(~picked, float("-inf")) if picked.dtype == torch.bool
                      else scores + picked)
        return _safe_softmax(scores.masked_fill(~self.held(), float("-inf")))

    def weights_for(self, other: "_Positions", probs):
        """``probs (..., positions)`` over this side's positions as weights over ``other``'s:
        as they are where both sides hold their tokens in the same positions (one layer's two
        sides), else gathered by token (zero where ``other`` holds no token)."""
        if (type(self) is type(other) and (self.codes is None) == (other.codes is None)
                and self.slots == other.slots and self.order is other.order):
            torch._check(self.length == other.length)
            torch._check(self.rows == other.rows)
            return probs
        at = self.position_of_token().index_select(0, other.token_of_position())
        return probs.index_select(-1, at).masked_fill(~other.held(), 0.0)

    def sums(self, p):
        """``Σ_position p·side`` for weights ``p (b, hk, m, positions)``:
        ``(b, hk, m, width)``."""
        if self.codes is None:
            return p @ self.window.to(p.dtype)
        out = _code_sums(p[..., :self.slots], *self.codes)
        if self.window is not None:
            out = out + p[..., self.slots:] @ self.window.to(p.dtype)
        return out


class _VectorPositions(_Positions):
    """A side stored as product vector codes (``lorc::vector_latents``' arguments): the
    codes' slots (every whole block, spare blocks included; the first ``coded`` hold tokens),
    then the window's rows, each row's sink read in place of its position's code, each slot's
    code plus its chunk's drift offset where there is a drift table ``means``. Scores and
    sums read the codes (``lorc::vector_scores`` / ``vector_sums``), never the latent rebuilt,
    where their kernel serves; elsewhere they multiply the codes decoded.

    A static store's window is a ring (``ring_to`` given): every token has a slot, and the
    tokens from ``ring_from`` to ``ring_to`` are read from the ring's rows instead (token ``p``
    at row ``p % rows``): their slots hold no token, and a row holds one where its latest
    token is among them."""

    def __init__(self, payload, tables, window, coded, tokens, sink, sink_at, means=None,
                 chunk=0, ring_from=None, ring_to=None):
        self.codes, self.window, self.order = (list(payload), list(tables)), window, None
        self.length, self.rows, self.tokens = coded, window.shape[-2], tokens
        self.heads, self.device = 1, window.device
        self.slots = payload[0].shape[-1] // layout_of(tables)[0][3] * BLOCK
        self.sink, self.sink_at = sink, sink_at
        # each chunk's drift offset (b, 1, rows, r), or None
        self.offsets = None if means is None else drift.offsets(means)[:, None]
        self.chunk = chunk
        self.ring_from, self.ring_to = ring_from, ring_to
        if ring_to is not None:  # once a step: what every read of the positions masks by
            # (slots,): read from the ring instead
            self.slot_in_ring = in_ring(torch.arange(self.slots, device=self.device),
                                        ring_from, ring_to)
            last, rows = ring_to - 1, torch.arange(self.rows, device=self.device)
            self.ring_tokens = last - (last - rows) % self.rows  # each row's latest (< 0: none)
            self.ring_held = self.ring_tokens >= ring_from  # (rows,): read from there

    def held(self):
        if self.ring_to is None:
            return super().held()
        slots = torch.arange(self.slots, device=self.device) < self.length
        return torch.cat([slots & ~self.slot_in_ring, self.ring_held])

    def spread(self, x, dim: int):
        if self.ring_to is None:
            return super().spread(x, dim)
        dim %= x.dim()
        shape = [-1 if d == dim else 1 for d in range(x.dim())]  # a mask along ``dim``
        spare = list(x.shape)
        spare[dim] = self.slots - self.length
        slots = torch.cat([x.narrow(dim, 0, self.length), x.new_zeros(spare)], dim=dim)
        rows = x.index_select(dim, self.ring_tokens.clamp(0, self.tokens - 1))
        return torch.cat([torch.where(self.slot_in_ring.view(shape), torch.zeros_like(slots),
                                      slots),
                          torch.where(self.ring_held.view(shape), rows, torch.zeros_like(rows))],
                         dim=dim)

    def position_of_token(self):
        return token_positions(torch.arange(self.tokens, device=self.device), self.length,
                               self.slots, self.rows, self.ring_from, self.ring_to)

    def _decoded(self):
        """Every slot's latent ``(b, 1, slots, r)`` in float32, its drift offset added."""
        decoded = vector_decode(*self.codes)[:, None].float()
        if self.offsets is None:
            return decoded
        return decoded + drift.spread(self.offsets, self.slots, self.chunk, dim=2)

    def _sink_position(self, like, m: int):
        """Each row's sink's position, as an index ``(b, 1, m, 1)`` into ``like``'s last axis."""
        b = like.shape[0]
        at = (torch.zeros(b, dtype=torch.long, device=self.device) if self.sink_at is None
              else self.sink_at.long())
        at = token_positions(at, self.length, self.slots)
        return at.view(b, 1, 1, 1).expand(b, 1, m, 1)

    def scores(self, q):
        """``q (b, 1, m, r)`` against every position, a sink's by its latent:
        ``(b, 1, m, positions)``, unscaled."""
        q = q.float()
        if vector_reductions.native_applies(q.device):
            codes = torch.ops.lorc.vector_scores(q[:, 0], *self.codes)[:, None]
            if self.offsets is not None:  # each chunk's q·offset, spread over its slots
                by_chunk = q @ self.offsets.transpose(-1, -2)  # (b, 1, m, rows)
                codes = codes + drift.spread(by_chunk, self.slots, self.chunk, dim=-1)
        else:  # no kernel here: the codes decoded
            codes = q @ self._decoded().transpose(-1, -2)
        scores = torch.cat([codes, q @ self.window.transpose(-1, -2).float()], dim=-1)
        if self.sink is None:
            return scores
        return scores.scatter(-1, self._sink_position(q, q.shape[2]),
                              q @ self.sink.transpose(-1, -2).float())

    def turns(self) -> bool:
        """Whether ``turned_scores`` reads these codes in the C++ kernel."""
        return vector_reductions.turned_applies(self.device, self.codes[1])

    def turned_scores(self, ab, cos, sin, style: str, pairs):
        """Scores of keys cached before RoPE in a RoPE-commuting basis (each channel on rotary
        pair ``pairs[c]``): ``ab (b, m, 2r)`` each query row's ``(α, β)``
        (``per_frequency_queries``), ``cos``/``sin`` ``(b, positions, rotary_dim)`` every
        position's angles; ``(b, m, positions)``, unscaled. The codes' slots in the kernel
        (``lorc::vector_turned_scores``), the window's rows and each row's sink as floats."""
        ab = ab.float()
        rotary_dim = cos.shape[-1]
        slots = lambda x: per_pair(x[:, :self.slots], style).float()  # noqa: E731  (b, slots, P)
        at = torch.tensor(pairs, dtype=torch.int32)  # each channel's pair, a graph constant
        slot_cos, slot_sin = slots(cos), slots(sin)
        codes = torch.ops.lorc.vector_turned_scores(ab, slot_cos, slot_sin, at, *self.codes)
        if self.offsets is not None:
            codes = codes + self._turned_offsets(ab, slot_cos, slot_sin, pairs)
        window = self.window[:, 0].float()  # (b, rows, r)
        rows = turned(window, cos[:, self.slots:], sin[:, self.slots:], style, pairs)
        scores = torch.cat([codes, ab @ rows.transpose(1, 2)], dim=-1)
        if self.sink is None:
            return scores
        at = self._sink_position(scores, 1)[:, 0]  # (b, 1, 1)
        angle = lambda x: x.gather(1, at.expand(-1, -1, rotary_dim))  # noqa: E731
        sink = turned(self.sink[:, 0].float(), angle(cos), angle(sin), style, pairs)
        return scores.scatter(-1, at.expand(-1, ab.shape[1], 1), ab @ sink.transpose(1, 2))

    def _turned_offsets(self, ab, cos, sin, pairs):
        """The scores ``(b, m, slots)`` of each slot's drift offset turned by the slot's angles
        (``cos``/``sin`` ``(b, slots, P)``, one a rotary pair): an offset is constant over its
        chunk, so each query row's ``(α, β)`` times each chunk's offset is summed per pair
        first ``(b, m, rows, 2P)``, then dotted with the angles of the chunk's slots, a chunk at
        a time (``_by_chunk``)."""
        offsets = self.offsets[:, 0]  # (b, rows, r)
        r = offsets.shape[-1]
        per_pair = F.one_hot(torch.tensor(pairs), cos.shape[-1]).float()  # (r, P)
        by_pair = torch.cat([(ab[:, :, None, :r] * offsets[:, None]) @ per_pair,
                             (ab[:, :, None, r:] * offsets[:, None]) @ per_pair], dim=-1)
        angles = self._by_chunk(torch.cat([cos, sin], dim=-1), 1)  # (b, rows, chunk, 2P)
        scores = torch.einsum("bkjp,bmkp->bmkj", angles, by_pair)
        return scores.flatten(2).narrow(2, 0, self.slots)

    def values(self):
        """The side's latent in position order ``(b, 1, positions, r)``, a sink's as it came."""
        decoded = self._decoded().to(self.window.dtype)
        latents = torch.cat([decoded, self.window], dim=-2)
        if self.sink is None:
            return latents
        at = self._sink_position(latents, 1).expand(-1, -1, -1, latents.shape[-1])
        return latents.scatter(2, at, self.sink.to(latents.dtype))

    def sums(self, p):
        """``Σ_position p·latent`` for weights ``p (b, 1, m, positions)``: ``(b, 1, m, r)``; a
        sink's weight goes to its latent, not to its position's code."""
        p = p.float()
        if self.sink is not None:
            at = self._sink_position(p, p.shape[2])
            on_sink = p.gather(-1, at)  # (b, 1, m, 1)
            p = p.scatter(-1, at, torch.zeros_like(on_sink))
        if vector_reductions.native_applies(p.device):
            out = torch.ops.lorc.vector_sums(p[:, 0, :, :self.slots], *self.codes)[:, None]
            if self.offsets is not None:  # each chunk's weight times its offset
                out = out + self._offset_sums(p[..., :self.slots])
        else:  # no kernel here: the codes decoded
            out = p[..., :self.slots] @ self._decoded()
        out = out + p[..., self.slots:] @ self.window.float()
        return out if self.sink is None else out + on_sink * self.sink.float()

    def _offset_sums(self, p):
        """``Σ_slot p·offset`` for the slots' weights ``p (b, 1, m, slots)``: each chunk's
        weights summed, a chunk at a time (``_by_chunk``), times its offset; a reduction and a
        product Inductor fuses, where a scatter of the weights by row and a matmul were
        kernels of their own."""
        by_chunk = self._by_chunk(p, -1).sum(-1)  # (b, 1, m, rows)
        return (by_chunk[..., None] * self.offsets[:, :, None]).sum(-2)

    def _by_chunk(self, x, dim: int):
        """``x``, whose axis ``dim`` is the slots, zero-padded to ``rows·chunk`` slots (which
        cover every slot: ``stores.drift``) and split into ``(rows, chunk)``."""
        rows, dim = self.offsets.shape[2], dim % x.dim()
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, rows * self.chunk - self.slots]
        return F.pad(x, pad).unflatten(dim, (rows, self.chunk))


def _sum(x, dim: int):
    """``x.sum(dim)``, over a long axis of static length in two steps: whole chunks of
    ``SUM_CHUNK``, then the chunks and the rest. Inductor's C++ backend gives a float sum over
    more than 4096 elements of static length a cascade-summation helper
    (``need_use_acc_helper``) whose bookkeeping in the inner loop made a decode step's
    weighted sum of 8k tokens of per-token codes 3.6× slower (1.26 → 0.35 ms,
    ``bench/quantized_decode_attention.py``'s shape). The rest is summed apart rather than
    padded: a padded chunk puts a masked load in the innermost loop. A symbolic length gets
    no helper and is summed as it is."""
    dim %= x.dim()
    n = x.shape[dim]
    if not isinstance(n, int) or n <= SUM_CHUNK:
        return x.sum(dim)
    whole = n - n % SUM_CHUNK
    chunks = x.narrow(dim, 0, whole).unflatten(dim, (-1, SUM_CHUNK)).sum(dim + 1).sum(dim)
    return chunks + x.narrow(dim, whole, n - whole).sum(dim) if whole < n else chunks


def _stored(x, dim: int = -1):
    """``x`` exactly, as the output of a matrix product by the identity along ``dim`` (-1:
    from the right, -2: from the left, so the output keeps ``x``'s layout):
    Inductor writes a product's output to memory, so the reductions that read ``x`` once per
    code load it there. Without it Inductor inlines whatever computed ``x`` into their
    innermost loop: a decode step's query came with its RoPE, a ``cos`` and a ``sin`` per
    code read, which made the scores over 8k tokens of int8 keys 3× slower (3.47 → 1.16 ms
    per layer, ``bench/quantized_decode_attention.py``'s shape); the weights of a value sum
    came with the softmax and the gather from key to value positions. Exact: every other
    term of each sum is a product by zero."""
    dim %= x.dim()
    if dim < x.dim() - 2:
        raise ValueError(f"_stored multiplies along one of the last two dims, not dim {dim}")
    eye = torch.eye(x.shape[dim], dtype=x.dtype, device=x.device)
    return x @ eye if dim == x.dim() - 1 else eye @ x


def _safe_softmax(scores):
    """``torch._safe_softmax(scores, -1)`` (a row of ``-inf`` gets zeros) with its sum by
    ``_sum``."""
    top = scores.amax(-1, keepdim=True)
    exp = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))
    total = _sum(exp, -1).unsqueeze(-1)
    return torch.where(total > 0, exp / total, 0.0)


def _unpacked(payload, bits: int):
    """Packed codes ``(..., bytes)`` as floats ``(..., 8 // bits, bytes)``, in order once the
    last two axes are flattened (``codes.integer.pack_bits``: byte ``j`` holds code ``j`` of each
    run). The bytes stay the innermost axis, contiguous for the loads of a fused loop."""
    if bits == 8:
        return payload.unsqueeze(-2).float()
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=payload.device).unsqueeze(-1)
    return ((payload.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)).float()


def _code_scores(q, payload, scale, zero, bits: int, group: int, axis: int, length: int,
                 width: int, dtype: torch.dtype):
    """``q (b, hk, m, width)`` against every slot of per-channel codes:
    ``Σ_c (q_c·scale_c)·code_c + Σ_c q_c·zero_c``, ``(b, hk, m, slots)``; on CPU, by the
    C++ kernel ``lorc::code_scores`` where it serves the codes."""
    if native_applies(q.device, bits, group):
        return torch.ops.lorc.code_scores(q.float(), payload, scale, zero, bits)
    codes = _unpacked(payload, bits)  # (b, hk, width, groups, per, bytes)
    q = _stored(q.float())[..., None]  # (b, hk, m, width, 1)
    by_scale = q * scale.unsqueeze(2).float()  # (b, hk, m, width, groups)
    by_zero = (q * zero.unsqueeze(2).float()).sum(-2)  # (b, hk, m, groups)
    scores = (by_scale[..., None, None] * codes.unsqueeze(2)).sum(3) + by_zero[..., None, None]
    return scores.flatten(-3)


def _code_values(payload, scale, zero, bits: int, group: int, axis: int, length: int,
                 width: int, dtype: torch.dtype):
    """Per-channel codes dequantized, every slot: ``(b, hk, slots, width)`` in ``dtype``."""
    codes = _unpacked(payload, bits)  # (b, hk, width, groups, per, bytes)
    values = zero.float()[..., None, None] + codes * scale.float()[..., None, None]
    return values.flatten(-3).transpose(-1, -2).to(dtype)


def _code_sums(p, payload, scale, zero, bits: int, group: int, axis: int, length: int,
               width: int, dtype: torch.dtype):
    """``Σ_slot p·(zero + code·scale)`` for weights ``p (b, hk, m, slots)``:
    ``(b, hk, m, width)``; per token on CPU by the C++ kernel ``lorc::code_sums`` where it
    serves the codes."""
    if axis == -1 and native_applies(p.device, bits, group):
        return torch.ops.lorc.code_sums(p, payload, scale, zero, bits)[..., :width]
    codes = _unpacked(payload, bits)
    p = _stored(p.float(), -2)  # the short axis (query heads × tokens)
    if axis == -2:  # (b, hk, width, groups, per, bytes) along the tokens
        p = p.unflatten(-1, codes.shape[-3:])  # (b, hk, m, groups, per, bytes)
        by_code = (p.unsqueeze(3) * codes.unsqueeze(2)).sum((-2, -1))  # (b, hk, m, width, groups)
        per_group = p.sum((-2, -1)).unsqueeze(3)  # (b, hk, m, 1, groups)
        return (by_code * scale.unsqueeze(2).float() + per_group * zero.unsqueeze(2).float()).sum(-1)
    # per token: (b, hk, tokens, channel groups, per, bytes) along the channels
    by_scale = p[..., None] * scale.unsqueeze(2).float()  # (b, hk, m, tokens, channel groups)
    out = _sum(by_scale[..., None, None] * codes.unsqueeze(2), 3)  # (b, hk, m, groups, per, bytes)
    by_zero = _sum(p[..., None] * zero.unsqueeze(2).float(), 3)  # (b, hk, m, channel groups)
    return (out + by_zero[..., None, None]).flatten(-3)[..., :width]
