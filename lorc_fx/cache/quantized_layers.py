"""Cache layers that store latents as integer codes (KIVI-style), or, for plain KV-cache
quantization (a plan of ``kind == "plain"``), the keys and values themselves.

Each side has its own :class:`QuantSpec` (``None``: kept in the model's dtype):

- a latent side is quantized **per channel** over groups of G tokens: a latent's energy sits
  in its first channels, so one scale per channel follows their very different ranges, where
  one per token would spend its levels on channel 0;
- plain quantization stores keys per channel and values **per token** (groups of channels
  within a head), KIVI's layout: measured on the default model at 4 bits, values quantized
  per channel cost 2.3× the held-out loss of values per token (docs/design.md).

The tokens of a group of G not yet full stay in full precision in ``keys`` / ``values`` (the
residual window, fewer than G tokens, G the per-channel group); whole groups are quantized as
they fill, both sides together, so both always hold the same tokens.
"""
from __future__ import annotations

import torch
from transformers.utils import is_torchdynamo_compiling

from .latent_ops import dequantized
from .layers import LatentCodec, LatentDynamicLayer
from .quantize import (QuantizedTensor, QuantSpec, cat_tokens, first_tokens, map_batch,
                       quantize, token_count)


class QuantizedLatentDynamicLayer(LatentDynamicLayer):
    """A growing cache whose sides are stored as ``spec.bits``-bit codes where their spec
    (``k_spec`` / ``v_spec``) says, beside a full-precision residual window.

    ``k_quant`` / ``v_quant`` hold the quantized tokens (``None`` before the first group);
    ``keys`` / ``values`` the window. A side without a spec, or zero-wide, lives whole in its
    window. ``update`` returns what attention reads, rebuilt from the dequantized sides.
    ``crop`` keeps the whole groups before the cut as they are and moves the tokens of the
    cut group back into the window, dequantized (kept groups are never rounded twice); beam
    reordering and batch repeat/select index the packed codes along batch. The compiled path
    (``lorc_backend``) does not support it yet.
    """

    def __init__(self, bases: LatentCodec, k_spec: QuantSpec | None, v_spec: QuantSpec | None,
                 logs_rotary: bool = False):
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
        self.k_quant: QuantizedTensor | None = None
        self.v_quant: QuantizedTensor | None = None

    def _settle(self, quant: QuantizedTensor | None, window: torch.Tensor, spec: QuantSpec | None,
                whole: int):
        """Quantize the first ``whole`` tokens of the window; the rest stays in it."""
        if spec is None or whole == 0 or window.shape[-1] == 0:
            return quant, window
        quant = cat_tokens(quant, quantize(window[..., :whole, :], spec))
        return quant, window[..., whole:, :].clone()

    def get_seq_length(self) -> int:
        """Tokens cached: the keys' quantized tokens and residual window (a side kept raw
        holds every token in its window)."""
        if not self.is_initialized or self.keys is None or self.keys.dim() < 2:
            return 0
        return token_count(self.k_quant) + self.keys.shape[-2]

    def latents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached sides (latents, or keys and values of a plain plan), dequantized: what
        ``update`` rebuilds."""
        def whole(quant, window):
            return window if quant is None else torch.cat([dequantized(quant), window], dim=-2)
        return whole(self.k_quant, self.keys), whole(self.v_quant, self.values)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer holds: residual windows, packed codes, scales, zero points."""
        out = [self.keys, self.values]
        for q in (self.k_quant, self.v_quant):
            if q is not None:
                out += [q.payload, q.scale, q.zero]
        return [t for t in out if isinstance(t, torch.Tensor)]

    def update(self, key_states, value_states, *args, **kwargs):
        if is_torchdynamo_compiling():
            raise ValueError("latent_bits < 16 (quantized latents) is supported on the eager "
                             "path only; the compiled path (lorc_backend) needs latent_bits=16")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.logs_rotary:
            self.bases.rotary.append(None)
        k, v = self.bases.compress(key_states, value_states)
        self.keys = torch.cat([self.keys, k], dim=-2) if self.keys.dim() == 4 else k
        self.values = torch.cat([self.values, v], dim=-2) if self.values.dim() == 4 else v
        # whole groups of a quantized side's window (a side without a spec keeps every token)
        window = self.keys if self.k_spec is not None else self.values
        whole = window.shape[-2] // self.group * self.group
        self.k_quant, self.keys = self._settle(self.k_quant, self.keys, self.k_spec, whole)
        self.v_quant, self.values = self._settle(self.v_quant, self.values, self.v_spec, whole)
        return self.bases.expand(*self.latents())

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not "
                             "supported: pass a negative number of tokens to remove")
        length = self.get_seq_length()
        if tokens_to_remove == 0 or length == 0:
            return
        keep = max(length + tokens_to_remove, 0)
        kept_groups = keep // self.group * self.group

        def cut(quant, window):
            stored = token_count(quant)
            if keep >= stored:
                return quant, window[..., :keep - stored, :]
            tail = quant.dequantize()[..., kept_groups:keep, :].clone()
            return first_tokens(quant, kept_groups), tail

        self.k_quant, self.keys = cut(self.k_quant, self.keys)
        self.v_quant, self.values = cut(self.v_quant, self.values)
        if self._log() is not None:
            self._log().crop(tokens_to_remove)

    def _map_quantized(self, fn) -> None:
        self.k_quant, self.v_quant = map_batch(self.k_quant, fn), map_batch(self.v_quant, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_quantized(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_quantized(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_quantized(lambda t: t[indices, ...])

    def reset(self) -> None:
        super().reset()
        self.k_quant = self.v_quant = None

    def offload(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")

    def prefetch(self):
        raise NotImplementedError("offloading a quantized latent layer is not supported")
