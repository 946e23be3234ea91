"""The custom ops the latent cache is made of.

``lorc::project`` turns keys/values ``(b, h_kv, s, d)`` into a latent ``(b, 1, s, r)``;
``lorc::reconstruct`` turns a latent back into ``(b, h_kv, n, d)``;
``lorc::rotated_reconstruct`` does that and rotates the rebuilt keys by the RoPE angles of
their positions (keys cached before RoPE, ``reconstruct`` mode); ``lorc::dequantize`` turns
the packed codes of a quantized side back into floats. As ops they reach the
dynamo graph as single nodes whose arguments are the latent and its basis, so the backend
finds attention over a latent by data flow, not by pattern-matching matmul chains. The
``*_math`` functions are the same maths in plain torch ops: the backend swaps them in for
whatever ops it does not rewrite away, so Inductor can fuse them.
"""
from __future__ import annotations

import torch

from lorc_fx.codes.integer import QuantizedTensor, QuantSpec, SplitTensor
from lorc_fx.codes.integer import dequantize as dequantize_math
from .rotary import rotate


def project_math(states: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    b, h, s, d = states.shape
    flat = states.transpose(1, 2).reshape(b, s, h * d)
    return (flat @ basis.t()).unsqueeze(1)


def reconstruct_math(latent: torch.Tensor, basis: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, _, n, _ = latent.shape
    full = latent.squeeze(1) @ basis
    return full.view(b, n, num_heads, basis.shape[1] // num_heads).transpose(1, 2)  # n may be 0


@torch.library.custom_op("lorc::project", mutates_args=())
def project(states: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``(b, h_kv, s, d)`` and ``basis (r, h_kv*d)`` → latent ``(b, 1, s, r)``."""
    return project_math(states, basis).contiguous()


@project.register_fake
def _(states, basis):
    b, _, s, _ = states.shape
    return states.new_empty(b, 1, s, basis.shape[0])


@torch.library.custom_op("lorc::reconstruct", mutates_args=())
def reconstruct(latent: torch.Tensor, basis: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Latent ``(b, 1, n, r)`` and ``basis (r, h_kv*d)`` → ``(b, h_kv, n, d)``."""
    return reconstruct_math(latent, basis, num_heads).contiguous()


@reconstruct.register_fake
def _(latent, basis, num_heads):
    b, _, n, _ = latent.shape
    return latent.new_empty(b, num_heads, n, basis.shape[1] // num_heads)


def rotated_reconstruct_math(latent: torch.Tensor, basis: torch.Tensor, num_heads: int,
                             cos: torch.Tensor, sin: torch.Tensor, style: str,
                             pairs: list[int] | None = None) -> torch.Tensor:
    return rotate(reconstruct_math(latent, basis, num_heads), cos, sin, style)


@torch.library.custom_op("lorc::rotated_reconstruct", mutates_args=())
def rotated_reconstruct(latent: torch.Tensor, basis: torch.Tensor, num_heads: int,
                        cos: torch.Tensor, sin: torch.Tensor, style: str,
                        pairs: list[int] | None = None) -> torch.Tensor:
    """Pre-RoPE key latent ``(b, 1, n, r)`` → keys ``(b, h_kv, n, d)`` rotated by ``cos``/``sin``
    ``(b, n, rotary_dim)`` in the rotary layout ``style`` (``rotary.rotate``). ``pairs``: where
    each basis row lies on one rotary pair's dims (of every head), that pair's index per row
    (``rotary.frequency_pairs``); decode attention then scores the latent without rebuilding
    keys (``compile.latent_attention.per_frequency_scores``). The keys are the same either way."""
    return rotated_reconstruct_math(latent, basis, num_heads, cos, sin, style).contiguous()


@rotated_reconstruct.register_fake
def _(latent, basis, num_heads, cos, sin, style, pairs=None):
    b, _, n, _ = latent.shape
    return latent.new_empty(b, num_heads, n, basis.shape[1] // num_heads)


def _quantized(payload, scale, zero, bits: int, group: int, axis: int, length: int,
               dtype: torch.dtype) -> QuantizedTensor:
    """The ``QuantizedTensor`` of a ``(b, h, length, d)`` cache side of ``dtype`` whose codes
    are ``payload`` (``codes/integer.py``'s layout; ``axis`` -2 per channel, -1 per token)."""
    b, h = payload.shape[:2]
    if axis == -2:  # (b, h, d, groups, bytes)
        d = payload.shape[2]
    else:  # (b, h, n, groups, bytes): channels padded to whole groups
        d = payload.shape[3] * group
    return QuantizedTensor(payload, scale, zero, QuantSpec(bits, group, axis, scale.dtype),
                           (b, h, length, d), dtype)


def dequantize_codes_math(payload, scale, zero, bits: int, group: int, axis: int, length: int,
                          width: int, dtype: torch.dtype) -> torch.Tensor:
    """``lorc::dequantize`` in plain torch ops (its lowering), contiguous: traced through AOT
    autograd a per-channel side otherwise comes out with its last dim strided, and SDPA over
    it falls back from the fused CPU kernel to unfused maths (a compiled prefill ran 2.3×
    slower at 4096 tokens); Inductor writes the contiguous layout in the kernel that
    computes it."""
    out = dequantize_math(_quantized(payload, scale, zero, bits, group, axis, length, dtype))
    return out[..., :width].contiguous()


@torch.library.custom_op("lorc::dequantize", mutates_args=())
def dequantize_codes(payload: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                     group: int, axis: int, length: int, width: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Packed codes of a quantized cache side → ``(b, h, length, width)`` in ``dtype`` (the
    side's; its scales may be narrower: ``codes.integer.dequantize``): one node in a traced graph,
    so the backend finds attention over quantized latents by data flow, as it does over
    ``lorc::reconstruct``."""
    return dequantize_codes_math(payload, scale, zero, bits, group, axis, length, width, dtype)


@dequantize_codes.register_fake
def _(payload, scale, zero, bits, group, axis, length, width, dtype):
    return scale.new_empty(payload.shape[0], payload.shape[1], length, width, dtype=dtype)


def dequantized(q: QuantizedTensor | SplitTensor) -> torch.Tensor:
    """``q`` dequantized through ``lorc::dequantize`` (a split side: one node per run of
    channels, concatenated along the channels)."""
    if isinstance(q, SplitTensor):
        return torch.cat([dequantized(p) for p in q.parts], dim=-1)
    return dequantize_codes(q.payload, q.scale, q.zero, q.spec.bits, q.spec.group,
                            -2 if q.spec.axis % 4 == 2 else -1, q.shape[2], q.shape[3], q.dtype)


PROJECT = torch.ops.lorc.project.default
RECONSTRUCT = torch.ops.lorc.reconstruct.default
ROTATED_RECONSTRUCT = torch.ops.lorc.rotated_reconstruct.default
DEQUANTIZE = torch.ops.lorc.dequantize.default
LOWERINGS = {PROJECT: project_math, RECONSTRUCT: reconstruct_math,
             ROTATED_RECONSTRUCT: rotated_reconstruct_math, DEQUANTIZE: dequantize_codes_math}
