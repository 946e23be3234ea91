"""Cache layers that store latents as integer codes (KIVI-style), or, for plain KV-cache
quantization (a plan of ``kind == "plain"``), the keys and values themselves.

Each side has its own :class:`QuantSpec` (``None``: kept in the model's dtype), or, for keys
water-filled over channel widths, a :class:`ChannelSplit` (per channel, one spec per run of
channels of one width; the window and the groups are shared by the runs):

- a latent side is quantized **per channel** over groups of G tokens: a latent's energy sits
  in its first channels, so one scale per channel follows their very different ranges, where
  one per token would spend its levels on channel 0;
- plain quantization stores keys per channel and values **per token** (groups of channels
  within a head), KIVI's layout: measured on the default model at 4 bits, values quantized
  per channel cost 2.3× the held-out loss of values per token (docs/design.md).

The tokens of a group of G not yet full stay in full precision in ``keys`` / ``values`` (the
residual window, fewer than G tokens, G the per-channel group); whole groups are quantized as
they fill, both sides together, so both always hold the same tokens.

Traced by dynamo (``lorc_backend``), ``update`` has no branch on how many groups fill, and
no tensor it computes with has a length that could be 0 or 1 once decoding runs (dynamo
specialises on such lengths: a graph per case). So a quantized side keeps **spare slots**:
``SPARE_GROUPS`` groups of code slots past its quantized tokens, and ``SPARE_ROWS`` rows past
the tokens of its window. A step writes the incoming tokens over the window's spare rows,
quantizes the window's first group (padded to a whole group) over the spare group slots
(``quantize.splice_tokens``), and keeps that group, and drops it from the window, only when
the window filled. What attention reads is ``cat([lorc::dequantize(codes), window])`` cut to
the tokens. docs/design.md ("Quantized latents") counts the graphs this leaves.
"""
from __future__ import annotations

import torch

from .latent_ops import dequantized
from .layers import LatentCodec, LatentDynamicLayer, StoresBesideWindow
from .quantize import (ChannelSplit, QuantizedTensor, QuantSpec, SplitTensor, map_batch,
                       quantize, splice_tokens, token_count, token_slots)


Stored = QuantizedTensor | SplitTensor  # a side's codes: one width, or runs of several

SPARE_GROUPS = 2  # groups of code slots a quantized side keeps past its tokens
SPARE_ROWS = 2  # rows its window keeps past its tokens


class QuantizedLatentDynamicLayer(StoresBesideWindow, LatentDynamicLayer):
    """A growing cache whose sides are stored as ``spec.bits``-bit codes where their spec
    (``k_spec`` / ``v_spec``) says, beside a full-precision residual window.

    ``k_store`` / ``v_store`` hold the quantized tokens and ``SPARE_GROUPS`` spare groups of
    slots after them (``None`` before the first update); ``k_quant`` / ``v_quant`` are the
    quantized tokens alone (``None`` while there are none). ``keys`` / ``values`` hold the
    window: its tokens, then ``SPARE_ROWS`` spare rows (``window_tokens()``: the tokens alone).
    A side without a spec, or zero-wide, lives whole in ``keys`` / ``values``, without spare
    rows. ``update`` returns what attention reads, rebuilt from the dequantized sides.
    ``crop`` keeps the whole groups before the cut as they are and moves the tokens of the
    cut group back into the window, dequantized (kept groups are never rounded twice); beam
    reordering and batch repeat/select index the packed codes along batch.
    """

    def __init__(self, bases: LatentCodec, k_spec: QuantSpec | ChannelSplit | None,
                 v_spec: QuantSpec | None, logs_rotary: bool = False):
        for spec in (k_spec, v_spec):
            if spec is not None and (not spec.quantized or spec.axis not in (-2, -1)):
                raise ValueError("a quantized layer takes specs of fewer than 16 bits, per "
                                 "channel (QuantSpec.per_channel) or per token (per_token)")
        if k_spec is None and v_spec is None:
            raise ValueError("a quantized layer quantizes at least one side")
        super().__init__(bases, logs_rotary)
        self.k_spec, self.v_spec = k_spec, v_spec
        # tokens per settled group: the per-channel group (per-token codes need none)
        self.group = max([s.group for s in (k_spec, v_spec) if s is not None and s.axis == -2],
                         default=1)
        self.k_store: Stored | None = None
        self.v_store: Stored | None = None

    @property
    def k_quant(self) -> Stored | None:
        return _stored_tokens(self.k_store)

    @property
    def v_quant(self) -> Stored | None:
        return _stored_tokens(self.v_store)

    def window_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of the keys' and values' windows, without spare rows."""
        return _window_tokens(self.k_store, self.keys), _window_tokens(self.v_store, self.values)

    def _append(self, store: Stored | None, window: torch.Tensor, new: torch.Tensor,
                spec: QuantSpec | ChannelSplit | None):
        """``new`` tokens after the side's, then the whole groups its window starts with
        quantized (the window held fewer than G tokens before). Returns (store, window)."""
        if spec is None or new.shape[-1] == 0:  # kept in the model's dtype: no spare anything
            return store, torch.cat([window, new], dim=-2) if window.dim() == 4 else new
        if store is None:  # the first tokens: spare slots only
            spare = new.new_zeros(*new.shape[:-2], SPARE_GROUPS * self.group, new.shape[-1])
            store = token_slots(quantize(spare, spec), 0, SPARE_GROUPS * self.group)
            window = _with_spare_rows(new[..., :0, :])
        held, incoming = window.shape[-2] - SPARE_ROWS, new.shape[-2]
        tokens = held + incoming
        # the window's tokens, the new ones over its spare rows, spare rows and one row more:
        # the rows kept are never the whole tensor, so they are a view of one density (not
        # contiguous in some steps and in others, which dynamo would tell apart)
        grown = torch.cat([window, new.new_zeros(*new.shape[:-2], incoming + 1, new.shape[-1])],
                          dim=-2).slice_scatter(new, dim=2, start=held, end=tokens)
        whole = tokens // self.group * self.group
        if not torch.compiler.is_compiling() and whole == 0:  # eager: nothing filled
            return store, grown.narrow(2, 0, tokens + SPARE_ROWS)
        # quantize as many groups as can have filled and one more (a static shape; rows past
        # the tokens are padding), keep `whole` tokens of them and the spare slots
        quantized = (self.group - 1 + incoming) // self.group * self.group + self.group
        rows = torch.cat([grown, grown.new_zeros(*new.shape[:-2], quantized, new.shape[-1])],
                         dim=-2).narrow(2, 0, quantized)
        stored = token_count(store) + whole
        store = splice_tokens(store, quantize(rows, spec), stored,
                              stored + SPARE_GROUPS * self.group)
        # a copy (a few rows): a view would start at a varying offset, another thing dynamo
        # tells apart
        return store, grown.narrow(2, whole, tokens + SPARE_ROWS - whole).clone()

    def get_seq_length(self) -> int:
        """Tokens cached: the keys' quantized tokens and window tokens (a side kept raw holds
        every token in its window)."""
        if not self.is_initialized or self.keys is None or self.keys.dim() < 2:
            return 0
        return _token_count(self.k_store, self.keys)

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached sides (latents, or keys and values of a plain plan), dequantized: what
        ``update`` rebuilds."""
        return _side(self.k_store, self.keys), _side(self.v_store, self.values)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds, as far as it holds tokens: window tokens, packed
        codes, scales, zero points (spare slots and rows are not counted)."""
        out = list(self.window_tokens())
        for q in (self.k_quant, self.v_quant):
            if q is not None:
                out += q.tensors
        return [t for t in out if isinstance(t, torch.Tensor)]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            self.bases.rotary.append(None)
        k, v = self.bases.compress(key_states, value_states)
        self.k_store, self.keys = self._append(self.k_store, self.keys, k, self.k_spec)
        self.v_store, self.values = self._append(self.v_store, self.values, v, self.v_spec)
        return self.bases.expand(*self.latents())

    def crop(self, tokens_to_remove: int) -> None:
        keep = self._kept_after_crop(tokens_to_remove)
        if keep is None:
            return
        kept_groups = keep // self.group * self.group

        def cut(store, window):
            if store is None:
                return store, window[..., :keep, :]
            stored = token_count(store)
            if keep >= stored:
                return store, _with_spare_rows(window[..., :keep - stored, :])
            tail = store.dequantize()[..., kept_groups:keep, :]
            store = token_slots(store, kept_groups, kept_groups + SPARE_GROUPS * self.group,
                                copy=True)  # the slots of the groups after the kept ones
            return store, _with_spare_rows(tail)

        self.k_store, self.keys = cut(self.k_store, self.keys)
        self.v_store, self.values = cut(self.v_store, self.values)
        if self._log() is not None:
            self._log().crop(tokens_to_remove)

    def _map_stores(self, fn) -> None:
        self.k_store, self.v_store = map_batch(self.k_store, fn), map_batch(self.v_store, fn)

    def reset(self) -> None:
        super().reset()
        self.k_store = self.v_store = None


def _with_spare_rows(tokens: torch.Tensor) -> torch.Tensor:
    """A window of ``tokens`` followed by ``SPARE_ROWS`` rows."""
    spare = tokens.new_zeros(*tokens.shape[:-2], SPARE_ROWS, tokens.shape[-1])
    return torch.cat([tokens, spare], dim=-2)


def _window_tokens(store: Stored | None, window: torch.Tensor) -> torch.Tensor:
    """The tokens of a side's window: all of it for a side kept raw, else all but the spare
    rows."""
    return window if store is None else window.narrow(2, 0, window.shape[-2] - SPARE_ROWS)


def _token_count(store: Stored | None, window: torch.Tensor) -> int:
    """A side's tokens, read off shapes (no view of the window's tokens: traced, a tensor of
    0 or 1 rows would make dynamo specialise)."""
    if store is None:
        return window.shape[-2]
    return token_count(store) + window.shape[-2] - SPARE_ROWS


def _side(store: Stored | None, window: torch.Tensor) -> torch.Tensor:
    """A side's tokens, dequantized: ``cat([lorc::dequantize(codes), window])`` cut to the
    tokens (the window's spare rows come last)."""
    if store is None:
        return window
    return torch.cat([dequantized(store), window], dim=-2).narrow(2, 0, _token_count(store, window))


def _stored_tokens(store: Stored | None) -> Stored | None:
    """The tokens of a store without its spare slots; ``None`` when it holds none."""
    tokens = token_count(store)
    return None if tokens == 0 else token_slots(store, tokens, tokens)
