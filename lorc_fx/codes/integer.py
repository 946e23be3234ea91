"""Asymmetric integer group quantization for cache tensors (KIVI-style).

A group is ``group`` consecutive elements along one axis of the tensor; every group keeps a
scale and a zero point (its rounded-down minimum), and each element an unsigned code
``q = round((x - zero) / scale)`` of ``bits`` bits, so ``x ≈ zero + q·scale``. Two layouts of a
``(batch, heads, tokens, head_dim)`` cache tensor matter (KIVI):

- **per channel** (keys): groups run along the token axis, ``axis=-2``; each channel of each
  run of ``group`` tokens has its own scale, which follows the channels' very different
  ranges;
- **per token** (values): groups run along the channel axis, ``axis=-1``.

Codes are packed into a ``uint8`` payload: 8 bits one per byte; 4 bits two per byte and 2
bits four: the packed axis splits into ``8 // bits`` equal runs and byte ``j`` holds code
``j`` of every run, the first run in the lowest bits (``pack_int4``: the first half in the low
nibbles), so unpacking is a shift and a mask per run over contiguous bytes and gives the codes
in order (what lets a compiler fuse it into whatever reads them); 3 bits eight values in
three bytes, little-endian. ``bits=16`` means "not quantized": the tensor is kept as it is, in its
own dtype (16 bits per value in a 16-bit model).

A side whose channels are stored at several widths (``ChannelSplit``: keys water-filled by
energy, each channel at the width its share of the error buys) is one ``QuantizedTensor`` per
run of channels of one width, side by side along the channels (``SplitTensor``); every
function here that takes a quantized tensor takes one of those too, part by part.

Byte accounting counts everything: payload plus one scale and one zero point per group, both
stored in ``scale_dtype`` (the model's dtype when ``None``). ``QuantizedTensor.nbytes`` is
measured from the tensors; ``QuantSpec.nbytes(shape, dtype)`` predicts it exactly, and
``QuantSpec.bytes_per_value(dtype)`` is the per-value figure when the grouped axis is a whole
number of groups.

The scale and zero point are rounded to ``scale_dtype`` *before* the codes are computed (zero
rounded down, scale rounded up), so every element lies inside the representable range and the
round-trip error is at most ``scale/2`` per element (plus the rounding of the dequantized value
to the output dtype).

Traced by ``torch.compile`` (``torch.compiler.is_compiling()``) ``quantize`` skips its checks
of finite input and of ranges that fit ``scale_dtype``: a data-dependent branch would break
the graph. Non-finite values then give meaningless codes instead of an error.

This module imports nothing from lorc_fx.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8, 16)


@dataclass(frozen=True)
class QuantSpec:
    """``bits`` per code (2, 3, 4, 8; 16 = unquantized), ``group`` elements per scale/zero
    along ``axis`` (the axis the groups run along), scale/zero stored in ``scale_dtype``
    (``None``: the dtype of the quantized tensor)."""
    bits: int
    group: int = 64
    axis: int = -1
    scale_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, not {self.bits}")
        if self.bits != 16:
            if self.group < 1:
                raise ValueError(f"group must be positive, not {self.group}")
            if (self.group * self.bits) % 8:
                raise ValueError(f"a group of {self.group} {self.bits}-bit codes is not a whole "
                                 f"number of bytes")
            if self.scale_dtype is not None and not self.scale_dtype.is_floating_point:
                raise ValueError("scale_dtype must be a floating dtype")

    @classmethod
    def per_channel(cls, bits: int, group: int = 64, scale_dtype: torch.dtype | None = None):
        """Keys (KIVI): groups of ``group`` tokens along the token axis (-2), per channel."""
        return cls(bits, group, -2, scale_dtype)

    @classmethod
    def per_token(cls, bits: int, group: int = 64, scale_dtype: torch.dtype | None = None):
        """Values (KIVI): groups of ``group`` channels along the last axis, per token."""
        return cls(bits, group, -1, scale_dtype)

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    def _scale_bytes(self, dtype: torch.dtype | None) -> int:
        dtype = self.scale_dtype or dtype
        if dtype is None:
            raise ValueError("the spec has no scale_dtype: say the model's dtype")
        return torch.empty((), dtype=dtype).element_size()

    def bytes_per_value(self, dtype: torch.dtype | None = None) -> float:
        """Bytes per cached value, everything counted (payload + scale + zero point), when
        the grouped axis is a whole number of groups. ``dtype``: the model's dtype (the
        unquantized storage, and the scale/zero dtype when the spec names none)."""
        if not self.quantized:
            if dtype is None:
                raise ValueError("an unquantized spec stores the model's dtype: say which")
            return float(torch.empty((), dtype=dtype).element_size())
        return self.bits / 8 + 2 * self._scale_bytes(dtype) / self.group

    def bits_per_value(self, dtype: torch.dtype | None = None) -> float:
        return 8 * self.bytes_per_value(dtype)

    def nbytes(self, shape, dtype: torch.dtype) -> int:
        """Exact bytes ``quantize`` stores for a tensor of ``shape`` and ``dtype`` (a partial
        last group is padded to a whole group and has its own scale and zero point)."""
        shape = tuple(shape)
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not self.quantized:
            return numel * itemsize
        length = shape[self.axis]
        rows = numel // length if length else 0
        groups = -(-length // self.group)
        return rows * groups * (self.group * self.bits // 8 + 2 * self._scale_bytes(dtype))


@dataclass(frozen=True)
class QuantizedTensor:
    """``payload``: uint8 packed codes ``(..., groups, group·bits/8)`` with the grouped axis
    moved last; ``scale``/``zero``: ``(..., groups)``. For an unquantized spec the payload is
    the tensor itself and ``scale``/``zero`` are ``None``. The tensors may hold more slots than
    ``shape`` covers along an axis (a padded last group; a cache's spare slots,
    :func:`splice_tokens`): ``shape`` says what the codes stand for."""
    payload: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    spec: QuantSpec
    shape: tuple
    dtype: torch.dtype

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What it holds: the payload, and the scales and zero points of a quantized spec."""
        return tuple(t for t in (self.payload, self.scale, self.zero) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors, measured."""
        return sum(t.nbytes for t in self.tensors)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


@dataclass(frozen=True)
class ChannelSplit:
    """A ``(b, h, n, width)`` side stored per channel over groups of ``group`` tokens, its
    channels in runs of one width each: ``parts`` is ``(channels, bits)`` per run, in channel
    order (the runs cover the width); scales and zero points in ``scale_dtype``."""
    parts: tuple[tuple[int, int], ...]
    group: int
    scale_dtype: torch.dtype | None = None

    def __post_init__(self):
        if not self.parts or any(c < 1 for c, _ in self.parts):
            raise ValueError(f"a channel split needs runs of at least one channel, not {self.parts}")
        for _, bits in self.parts:  # each run a valid per-channel spec
            QuantSpec.per_channel(bits, self.group, self.scale_dtype)

    axis = -2  # per channel: groups run along the tokens
    quantized = True

    def specs(self) -> list[tuple[int, int, QuantSpec]]:
        """``(first channel, channels, spec)`` of every run."""
        out, at = [], 0
        for channels, bits in self.parts:
            out.append((at, channels, QuantSpec.per_channel(bits, self.group, self.scale_dtype)))
            at += channels
        return out

    @property
    def width(self) -> int:
        return sum(c for c, _ in self.parts)

    def nbytes(self, shape, dtype: torch.dtype) -> int:
        return sum(spec.nbytes((*tuple(shape)[:-1], channels), dtype)
                   for _, channels, spec in self.specs())

    def bits_per_value(self, dtype: torch.dtype | None = None) -> float:
        return sum(c * spec.bits_per_value(dtype) for _, c, spec in self.specs()) / self.width


@dataclass(frozen=True)
class SplitTensor:
    """A side quantized by a ``ChannelSplit``: one ``QuantizedTensor`` per run of channels."""
    parts: tuple[QuantizedTensor, ...]
    spec: ChannelSplit

    @property
    def shape(self) -> tuple:
        return (*self.parts[0].shape[:-1], sum(p.shape[-1] for p in self.parts))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.tensors)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def map(self, fn, *others: "SplitTensor") -> "SplitTensor":
        """``fn`` applied to each part (with the matching part of each of ``others``)."""
        return SplitTensor(tuple(fn(*ps) for ps in zip(self.parts, *(o.parts for o in others))),
                           self.spec)


# ---------------------------------------------------------------- packing

def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (any integer dtype, values in ``[0, 2**bits)``) along
    the last axis into uint8 (the layout of the module docstring): 8 codes fill ``bits``
    bytes. The last axis must hold a whole number of bytes of codes."""
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits are not a whole number of bytes")
    if bits in (2, 4):  # 8/bits runs; byte j holds code j of each
        per = 8 // bits
        runs = codes.to(torch.uint8).reshape(*codes.shape[:-1], per, n // per)
        out = runs[..., 0, :]
        for i in range(1, per):
            out = out | (runs[..., i, :] << (bits * i))
        return out
    # general: 8 codes -> one integer of 8·bits bits -> bits bytes
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], n // 8, 8)
    word = c[..., 0]
    for i in range(1, 8):
        word = word | (c[..., i] << (bits * i))
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits)], dim=-1)
    return out.to(torch.uint8).reshape(*codes.shape[:-1], n * bits // 8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint8 codes, ``8 // bits`` times as many along the last axis
    (``8/bits`` for 3 bits: 3 bytes -> 8 codes)."""
    if packed.dtype != torch.uint8:
        raise TypeError("packed codes are uint8")
    if bits == 8:
        return packed
    m = packed.shape[-1]
    mask = (1 << bits) - 1
    if bits in (2, 4):  # one shift per run, broadcast over a new axis before the bytes
        per = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
        return ((packed[..., None, :] >> shifts) & mask).reshape(*packed.shape[:-1], m * per)
    if m % bits:
        raise ValueError(f"{m} bytes are not a whole number of {bits}-byte words")
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], m // bits, bits)
    word = b[..., 0]
    for j in range(1, bits):
        word = word | (b[..., j] << (8 * j))
    parts = [(word >> (bits * i)) & mask for i in range(8)]
    return torch.stack(parts, dim=-1).to(torch.uint8).reshape(*packed.shape[:-1], m * 8 // bits)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis (even length): byte ``j`` holds code ``j``
    in its low nibble and code ``j + n/2`` in its high nibble."""
    return pack_bits(codes, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return unpack_bits(packed, 4)


# ---------------------------------------------------------------- quantization

def round_to(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype`` toward +inf (``up``) or -inf, as float32, in
    float32 arithmetic alone and without a branch on data (a traced graph has none).

    A narrower float's grid in the binade of ``x`` is the multiples of ``2**e · eps``
    (``2**e`` the binade's lowest power of two, read from the exponent bits of ``x``; below
    the narrower type's smallest normal, of its subnormal step), so the directed rounding is a
    floor or ceil of ``x`` over that step, exact in float32. Why not ``x.to(dtype)``: Inductor
    by default (``emulate_precision_casts=False``) drops a float round trip through a 16-bit
    dtype, which would leave scales and zero points unrounded in the codes' arithmetic, and
    reading 16-bit values through an integer bit cast keeps its CPU kernel from vectorizing
    (a compiled prefill spent 11 ms a layer quantizing 4096 tokens of keys that way). A value
    past ``dtype``'s largest comes out finite here and as inf once stored in ``dtype``."""
    if dtype.itemsize >= 4:  # float32: x itself; float64 holds it exactly
        return x.to(dtype).float()
    info = torch.finfo(dtype)
    binade = (x.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2 |x|)
    step = torch.clamp_min(binade * info.eps, info.smallest_normal * info.eps)
    steps = x / step  # a power of two: exact
    return (torch.ceil(steps) if up else torch.floor(steps)) * step


def zero_and_scale(lo: torch.Tensor, hi: torch.Tensor, levels: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero point, scale) as float32 of groups spanning ``[lo, hi]`` in ``levels`` steps,
    rounded outward to ``dtype`` (:func:`round_to`); an exactly constant group (every element
    equals its zero point) gets scale 1, as any scale works there."""
    zero = round_to(lo, dtype, up=False)
    scale = round_to((hi - zero) / levels, dtype, up=True)
    return zero, torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_groups(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
                    scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``bits``-bit codes, scales and zero points (in ``scale_dtype``) of the float32
    groups ``g (..., groups, group)``, each spanning ``[lo, hi]``: the arithmetic every
    quantized tensor and cache here shares, so their codes agree bit for bit."""
    zero, scale = zero_and_scale(lo, hi, (1 << bits) - 1, scale_dtype)
    return encode(g, zero, scale, bits), scale.to(scale_dtype), zero.to(scale_dtype)


def encode(g: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed ``bits``-bit codes of the float32 groups ``g (..., groups, group)`` under their
    (float32) zero points ``zero`` and scales ``scale`` ``(..., groups)``."""
    levels = (1 << bits) - 1
    codes = torch.round((g - zero[..., None]) / scale[..., None]).clamp_(0, levels)
    return pack_bits(codes.to(torch.uint8), bits)


def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` with the grouped axis last, padded (edge value) to whole groups and split:
    ``(..., groups, group)``."""
    y = x.movedim(spec.axis, -1)
    n = y.shape[-1]
    pad = -n % spec.group
    if pad:
        y = torch.cat([y, y[..., -1:].expand(*y.shape[:-1], pad)], dim=-1)
    return y.reshape(*y.shape[:-1], (n + pad) // spec.group, spec.group)


def quantize(x: torch.Tensor, spec: QuantSpec | ChannelSplit) -> QuantizedTensor | SplitTensor:
    """Quantize ``x`` by ``spec``; see the module docstring."""
    if not x.is_floating_point():
        raise TypeError("quantize takes a floating tensor")
    if isinstance(spec, ChannelSplit):
        if x.shape[-1] != spec.width:
            raise ValueError(f"a channel split of {spec.width} channels cannot hold "
                             f"{x.shape[-1]}")
        return SplitTensor(tuple(quantize(x[..., at:at + c], part)
                                 for at, c, part in spec.specs()), spec)
    if not spec.quantized:
        return QuantizedTensor(x, None, None, spec, tuple(x.shape), x.dtype)
    scale_dtype = spec.scale_dtype or x.dtype
    g = _grouped(x, spec).float()
    lo, hi = g.amin(-1), g.amax(-1)
    checked = not torch.compiler.is_compiling()  # a traced graph has no data-dependent branch
    if checked and not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("quantize takes finite values")
    payload, scale, zero = quantize_groups(g, lo, hi, spec.bits, scale_dtype)
    if checked and not bool(torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise OverflowError(f"the groups' ranges do not fit scale_dtype {scale_dtype}")
    return QuantizedTensor(payload, scale, zero, spec, tuple(x.shape), x.dtype)


def dequantize(q: QuantizedTensor | SplitTensor) -> torch.Tensor:
    """The tensor ``q`` stands for: ``zero + code·scale``, in the original dtype and shape."""
    if isinstance(q, SplitTensor):
        return torch.cat([dequantize(p) for p in q.parts], dim=-1)
    if not q.spec.quantized:
        return q.payload
    codes = unpack_bits(q.payload, q.spec.bits).float()
    y = q.zero.float()[..., None] + codes * q.scale.float()[..., None]
    y = y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1]).movedim(-1, q.spec.axis)
    # the padding of the last group, and any spare slots (``splice_tokens``), cut off
    return y[tuple(slice(0, n) for n in q.shape)].to(q.dtype)


# ---------------------------------------------------------------- the token axis of a cache tensor

def _token_dims(q: QuantizedTensor) -> tuple[int, int, int]:
    """Where the token axis of a quantized ``(b, h, n, d)`` cache tensor lies: (its dim in the
    payload, its dim in scale/zero, tokens per index along it). Per channel the groups run
    along the tokens (payload ``(b, h, d, groups, bytes)``: one index a group); per token
    along the channels (payload ``(b, h, n, groups, bytes)``: one index a token)."""
    if q.spec.axis % 4 == 2:
        return -2, -1, q.spec.group
    return 2, 2, 1


def token_count(q: QuantizedTensor | SplitTensor | None) -> int:
    return 0 if q is None else q.shape[2]


def token_slots(q: QuantizedTensor | SplitTensor, tokens: int, slots: int,
                copy: bool = False) -> QuantizedTensor | SplitTensor:
    """``q`` standing for its first ``tokens`` tokens, its tensors cut to ``slots`` token slots
    (``tokens`` or more, per channel whole groups): a view, or a copy."""
    if isinstance(q, SplitTensor):
        return q.map(lambda p: token_slots(p, tokens, slots, copy))
    dim, scale_dim, per = _token_dims(q)
    if tokens % per or slots % per:
        raise ValueError(f"{tokens} tokens in {slots} slots are not whole groups of {per}")
    cut = lambda t, d: t.narrow(d, 0, slots // per).clone() if copy else t.narrow(d, 0, slots // per)
    return QuantizedTensor(cut(q.payload, dim), cut(q.scale, scale_dim), cut(q.zero, scale_dim),
                           q.spec, (*q.shape[:2], tokens, q.shape[3]), q.dtype)


def drop_tokens(q: QuantizedTensor | SplitTensor, tokens: int) -> QuantizedTensor | SplitTensor:
    """``q`` without its first ``tokens`` tokens (per channel whole groups), a copy: its
    tensors keep every slot after them (spare slots included), so a sliding-window cache
    frees what has left its window."""
    if isinstance(q, SplitTensor):
        return q.map(lambda p: drop_tokens(p, tokens))
    dim, scale_dim, per = _token_dims(q)
    if tokens % per or tokens > q.shape[2]:
        raise ValueError(f"cannot drop {tokens} of {q.shape[2]} tokens in groups of {per}")
    cut = lambda t, d: t.narrow(d, tokens // per, t.shape[d] - tokens // per).clone()
    return QuantizedTensor(cut(q.payload, dim), cut(q.scale, scale_dim), cut(q.zero, scale_dim),
                           q.spec, (*q.shape[:2], q.shape[2] - tokens, q.shape[3]), q.dtype)


def splice_tokens(q: QuantizedTensor | SplitTensor, new: QuantizedTensor | SplitTensor,
                  tokens: int, slots: int) -> QuantizedTensor | SplitTensor:
    """``q``'s tokens followed by ``new``'s codes, standing for ``tokens`` tokens in ``slots``
    token slots (one new tensor; the slots past ``q``'s tokens and ``new``'s hold copies of
    other slots; ``slots`` at most ``q``'s slots plus ``new``'s). Every size is
    arithmetic of the inputs' sizes and nothing depends on how many of ``new``'s tokens are
    kept, so a traced caller needs no branch on it."""
    if isinstance(q, SplitTensor):
        return q.map(lambda p, n: splice_tokens(p, n, tokens, slots), new)
    dim, scale_dim, per = _token_dims(q)
    spliced = lambda old, fresh, d: splice(old, fresh, d, q.shape[2] // per, slots // per)
    return QuantizedTensor(spliced(q.payload, new.payload, dim),
                           spliced(q.scale, new.scale, scale_dim),
                           spliced(q.zero, new.zero, scale_dim), q.spec,
                           (*q.shape[:2], tokens, q.shape[3]), q.dtype)


def splice(old: torch.Tensor, fresh: torch.Tensor, dim: int, at: int, size: int) -> torch.Tensor:
    """``old``'s first ``at`` slots along ``dim``, then ``fresh``'s, ``size`` in all (slots
    past both hold copies of other slots). Gathered from one concatenation: Inductor (CPU)
    writes each part of a ``cat`` into its slice once, where a ``slice_scatter`` of ``fresh``
    computed it again, quantization inline, for every slot of the result (1.4 against 0.47 ms
    per 1024-token append, docs/design.md)."""
    dim %= old.dim()
    both = torch.cat([old, fresh], dim=dim)
    slot = torch.arange(size, device=old.device)
    from_fresh = (slot - at + old.shape[dim]).clamp(max=both.shape[dim] - 1)
    return both.index_select(dim, torch.where(slot < at, slot, from_fresh))


def token_axes(q: QuantizedTensor | SplitTensor | None) -> list[tuple[torch.Tensor, int]]:
    """Each tensor of ``q`` with the axis that grows with the tokens (payload, scale, zero)."""
    if q is None:
        return []
    if isinstance(q, SplitTensor):
        return [axis for part in q.parts for axis in token_axes(part)]
    dim, scale_dim, _ = _token_dims(q)
    return [(q.payload, dim % q.payload.dim()), (q.scale, scale_dim % q.scale.dim()),
            (q.zero, scale_dim % q.zero.dim())]


def map_batch(q: QuantizedTensor | SplitTensor | None, fn
              ) -> QuantizedTensor | SplitTensor | None:
    """``q`` with ``fn`` (an operation on the batch axis 0) applied to its tensors."""
    if q is None:
        return None
    if isinstance(q, SplitTensor):
        return q.map(lambda p: map_batch(p, fn))
    payload = fn(q.payload)
    return QuantizedTensor(payload, fn(q.scale), fn(q.zero), q.spec,
                           (payload.shape[0], *q.shape[1:]), q.dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec | ChannelSplit) -> tuple[torch.Tensor, int]:
    """``dequantize(quantize(x))`` and the bytes the quantized form holds."""
    q = quantize(x, spec)
    return dequantize(q), q.nbytes
