"""The dynamic store of a side stored as integer codes (KIVI-style): latents, or, for plain
KV-cache quantization, the keys and values themselves.

A side's code is a :class:`QuantSpec`, or, for keys water-filled over channel widths, a
:class:`ChannelSplit` (per channel, one spec per run of channels of one width; the window and
the groups are shared by the runs):

- a latent side is quantized **per channel** over groups of G tokens: a latent's energy sits
  in its first channels, so one scale per channel follows their very different ranges, where
  one per token would spend its levels on channel 0;
- plain quantization stores keys per channel and values **per token** (groups of channels
  within a head), KIVI's layout: measured on the default model at 4 bits, values quantized
  per channel cost 2.3× the held-out loss of values per token (docs/schemes/plain.md).

The tokens of a group of G not yet full stay in full precision in ``keys`` / ``values`` (the
residual window, fewer than G tokens, G the layer's per-channel group: ``stores.settle_group``);
whole groups are quantized as they fill, both sides together, so both always hold the same
tokens.

Traced by dynamo (``lorc_backend``), ``update`` has no branch on how many groups fill, and
no tensor it computes with has a length that could be 0 or 1 once decoding runs (dynamo
specialises on such lengths: a graph per case). So a quantized side keeps **spare slots**:
``SPARE_GROUPS`` groups of code slots past its quantized tokens, and ``SPARE_ROWS`` rows past
the tokens of its window. A step writes the incoming tokens over the window's spare rows,
quantizes the window's first group (padded to a whole group) over the spare group slots
(``codes.integer.splice_tokens``), and keeps that group, and drops it from the window, only when
the window filled. What attention reads is ``cat([lorc::dequantize(codes), window])`` cut to
the tokens. docs/design.md ("Quantized latents") counts the graphs this leaves.

``cut`` keeps the whole groups before the cut as they are and moves the tokens of the cut
group back into the window, dequantized (kept groups are never rounded twice).
"""
from __future__ import annotations

import torch

from lorc_fx.codes.integer import (ChannelSplit, QuantizedTensor, QuantSpec, SplitTensor,
                                   drop_tokens, map_batch, quantize, splice_tokens,
                                   token_axes, token_count, token_slots)

from ..latent_ops import dequantized

Stored = QuantizedTensor | SplitTensor  # a side's codes: one width, or runs of several

SPARE_GROUPS = 2  # groups of code slots a quantized side keeps past its tokens
SPARE_ROWS = 2  # rows its window keeps past its tokens


class IntegerStore:
    """A side stored as ``spec.bits``-bit codes beside a full-precision residual window.

    ``codes`` holds the quantized tokens and ``SPARE_GROUPS`` spare groups of slots after them
    (``None`` before the first tokens); ``quantized`` is the quantized tokens alone (``None``
    while there are none). The window holds its tokens, then ``SPARE_ROWS`` spare rows
    (``window_tokens``: the tokens alone). A zero-wide side lives whole in its window."""

    def __init__(self, spec: QuantSpec | ChannelSplit, group: int):
        if not spec.quantized or spec.axis not in (-2, -1):
            raise ValueError("an integer store takes specs of fewer than 16 bits, per channel "
                             "(QuantSpec.per_channel) or per token (per_token)")
        self.spec, self.group = spec, group
        self.codes: Stored | None = None

    @property
    def quantized(self) -> Stored | None:
        """The codes of the quantized tokens, without spare slots; None while there are none."""
        tokens = token_count(self.codes)
        return None if tokens == 0 else token_slots(self.codes, tokens, tokens)

    def window_tokens(self, window: torch.Tensor) -> torch.Tensor:
        """The tokens of the window, without spare rows."""
        return window if self.codes is None else window.narrow(2, 0, window.shape[-2] - SPARE_ROWS)

    def append(self, window: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """``new`` tokens after the side's, then the whole groups its window starts with
        quantized (the window held fewer than G tokens before). Returns the window."""
        if new.shape[-1] == 0:  # zero-wide: nothing to code, no spare anything
            return torch.cat([window, new], dim=-2) if window.dim() == 4 else new
        if self.codes is None:  # the first tokens: spare slots only
            spare = new.new_zeros(*new.shape[:-2], SPARE_GROUPS * self.group, new.shape[-1])
            self.codes = token_slots(quantize(spare, self.spec), 0, SPARE_GROUPS * self.group)
            window = with_spare_rows(new[..., :0, :])
        held, incoming = window.shape[-2] - SPARE_ROWS, new.shape[-2]
        tokens = held + incoming
        # the window's tokens, the new ones over its spare rows, spare rows and one row more:
        # the rows kept are never the whole tensor, so they are a view of one density (not
        # contiguous in some steps and in others, which dynamo would tell apart)
        grown = torch.cat([window, new.new_zeros(*new.shape[:-2], incoming + 1, new.shape[-1])],
                          dim=-2).slice_scatter(new, dim=2, start=held, end=tokens)
        whole = tokens // self.group * self.group
        if not torch.compiler.is_compiling() and whole == 0:  # eager: nothing filled
            return grown.narrow(2, 0, tokens + SPARE_ROWS)
        # quantize as many groups as can have filled and one more (a static shape; rows past
        # the tokens are padding), keep `whole` tokens of them and the spare slots
        quantized = (self.group - 1 + incoming) // self.group * self.group + self.group
        rows = torch.cat([grown, grown.new_zeros(*new.shape[:-2], quantized, new.shape[-1])],
                         dim=-2).narrow(2, 0, quantized)
        stored = token_count(self.codes) + whole
        self.codes = splice_tokens(self.codes, quantize(rows, self.spec), stored,
                                   stored + SPARE_GROUPS * self.group)
        # a copy (a few rows): a view would start at a varying offset, another thing dynamo
        # tells apart
        return grown.narrow(2, whole, tokens + SPARE_ROWS - whole).clone()

    def tokens(self, window: torch.Tensor) -> int:
        """Tokens held, read off shapes (no view of the window's tokens: traced, a tensor of
        0 or 1 rows would make dynamo specialise)."""
        if self.codes is None:
            return window.shape[-2] if window.dim() == 4 else 0
        return token_count(self.codes) + window.shape[-2] - SPARE_ROWS

    def read(self, window: torch.Tensor) -> torch.Tensor:
        """Every token, dequantized: ``cat([lorc::dequantize(codes), window])`` cut to the
        tokens (the window's spare rows come last)."""
        if self.codes is None:
            return window
        every = torch.cat([dequantized(self.codes), window], dim=-2)
        return every.narrow(2, 0, self.tokens(window))

    def cut(self, window: torch.Tensor, keep: int) -> torch.Tensor:
        """Keep the first ``keep`` tokens (fewer than held); returns the window."""
        if self.codes is None:
            return window[..., :keep, :]
        stored = token_count(self.codes)
        if keep >= stored:
            return with_spare_rows(window[..., :keep - stored, :])
        kept_groups = keep // self.group * self.group
        tail = self.codes.dequantize()[..., kept_groups:keep, :]
        self.codes = token_slots(self.codes, kept_groups,
                                 kept_groups + SPARE_GROUPS * self.group,
                                 copy=True)  # the slots of the groups after the kept ones
        return with_spare_rows(tail)

    def droppable(self, window: torch.Tensor, tokens: int) -> int:
        """How many of the oldest ``tokens`` tokens (at most those held) :meth:`drop` can
        drop: whole groups of codes, or every coded token and then window tokens."""
        coded = token_count(self.codes)
        return tokens if tokens >= coded else tokens // self.group * self.group

    def drop(self, window: torch.Tensor, tokens: int) -> torch.Tensor:
        """Drop the oldest ``tokens`` tokens (:meth:`droppable` of them: whole groups of codes
        first, then the window's first tokens); returns the window."""
        if tokens == 0:
            return window
        if self.codes is None:  # a zero-wide side: the window is every token
            return window[..., tokens:, :]
        coded = token_count(self.codes)
        if min(tokens, coded):
            self.codes = drop_tokens(self.codes, min(tokens, coded))
        rest = tokens - min(tokens, coded)
        return window[..., rest:, :].clone() if rest else window

    def token_axes(self, window: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """The window's and the codes' tensors, each with its axis that grows with tokens."""
        return ([(window, 2)] if window.dim() == 4 else []) + token_axes(self.codes)

    def map_batch(self, fn) -> None:
        self.codes = map_batch(self.codes, fn)

    def place_sinks(self, positions: torch.Tensor) -> None:
        pass  # every token is coded alike

    def tensors(self, window: torch.Tensor) -> list[torch.Tensor]:
        """The window's tokens, packed codes, scales and zero points, as far as they hold
        tokens (spare slots and rows are not counted)."""
        quantized = self.quantized
        return [self.window_tokens(window), *(quantized.tensors if quantized is not None else ())]


def with_spare_rows(tokens: torch.Tensor) -> torch.Tensor:
    """A window of ``tokens`` followed by ``SPARE_ROWS`` rows."""
    spare = tokens.new_zeros(*tokens.shape[:-2], SPARE_ROWS, tokens.shape[-1])
    return torch.cat([tokens, spare], dim=-2)
