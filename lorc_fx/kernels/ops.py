"""The decode attention op ``lorc::latent_decode``.

It is a ``torch.library.triton_op`` where Triton is installed, so Inductor sees the Triton
kernels it launches (plain ``custom_op``s without it: torch warns when a ``triton_op`` finds no
Triton to look into). It runs
the Triton kernels on CUDA tensors when Triton is installed, and the torch implementation of
:mod:`lorc_fx.kernels.reference` (float32 math, output in the input dtype) everywhere else, so the
op works on any device. Arguments:

- ``q``: ``(B, H, r_k)`` or ``(B, H, T, r_k)`` absorbed queries; output ``(B, H, r_v)`` or
  ``(B, H, T, r_v)`` in ``q.dtype``.
- ``c_k``, ``c_v``: latents ``(B, N, r)`` or the cache's ``(B, 1, N, r)``, any strides.
- ``mask``: bool ``(B, N)``, True = attend; ``start``, ``length``: int ``(B,)``, keys
  ``start <= n < start + length``; ``T > 1`` queries are bottom-right causal (see
  :mod:`lorc_fx.kernels.reference`). A query with no visible key outputs zeros.
- ``scale``: the original model's softmax scale (e.g. ``1/sqrt(d)``).
- ``num_splits``: sequence splits (flash-decoding); ``None`` picks one from the SM count.
  Ignored by the torch path.

Prefill (many query tokens) is not served by this op: rebuild full K/V from the latents
(``P^T c``) and call ``scaled_dot_product_attention``. Prefill is
compute-bound; the absorbed form would do ``r_k``- and ``r_v``-wide products per head instead of
``d``-wide ones, ``(r_k + r_v) / 2d`` times the attention FLOPs (4x at cache fraction 0.5 of a
``h_kv = 8``, ``d = 128`` layer), while the rebuild is one ``N x r x h_kv*d`` matmul per latent,
linear in ``N``, after which FlashAttention runs unchanged. Small ``T`` (a few tokens, e.g.
speculative decoding) stays on this op. This choice is unmeasured: no GPU was available to the
session that wrote it.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op, triton_op

from .reference import latent_decode_reference

try:
    from .latent_decode import latent_decode_triton
except ImportError as error:  # Triton is optional; the op then always uses the torch path
    if error.name != "triton":
        raise
    _HAS_TRITON = False
else:
    _HAS_TRITON = True

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_op = triton_op if _HAS_TRITON else custom_op


def triton_available() -> bool:
    """Whether Triton is installed (the kernels then run on CUDA tensors)."""
    return _HAS_TRITON


def _use_triton(q: Tensor) -> bool:
    return _HAS_TRITON and q.device.type == "cuda"


def _squeeze_cache(c: Tensor, name: str) -> Tensor:
    if c.dim() == 4 and c.shape[1] == 1:
        return c[:, 0]
    if c.dim() != 3:
        raise ValueError(f"{name} must be (B, N, r) or (B, 1, N, r), got {tuple(c.shape)}")
    return c


def _check_common(q: Tensor, c_k: Tensor, c_v: Tensor, mask, start, length):
    """Validate and normalise shapes: ``q`` to 4-D, latents to 3-D."""
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be (B, H, r) or (B, H, T, r), got {tuple(q.shape)}")
    q4 = q if q.dim() == 4 else q.unsqueeze(2)
    c_k, c_v = _squeeze_cache(c_k, "c_k"), _squeeze_cache(c_v, "c_v")
    batch, n = c_k.shape[:2]
    if q4.shape[0] != batch or tuple(c_v.shape[:2]) != (batch, n):
        raise ValueError(f"batch/length mismatch: q {tuple(q.shape)}, c_k {tuple(c_k.shape)}, "
                         f"c_v {tuple(c_v.shape)}")
    if c_k.device != q.device or c_v.device != q.device:
        raise ValueError(f"q, c_k, c_v on different devices: {q.device}, {c_k.device}, "
                         f"{c_v.device}")
    if q.dtype not in _DTYPES or c_k.dtype != q.dtype or c_v.dtype != q.dtype:
        raise ValueError(f"q, c_k, c_v must share one of {_DTYPES}: "
                         f"{q.dtype}, {c_k.dtype}, {c_v.dtype}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (batch, n)):
        raise ValueError(f"mask must be bool (B, N) = ({batch}, {n}), got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    for name, t in (("start", start), ("length", length)):
        if t is not None and (t.dtype not in (torch.int32, torch.int64)
                              or tuple(t.shape) != (batch,)):
            raise ValueError(f"{name} must be int32/int64 (B,) = ({batch},), got {t.dtype} "
                             f"{tuple(t.shape)}")
    return q4, c_k, c_v


def _output(out4: Tensor, q: Tensor) -> Tensor:
    return out4 if q.dim() == 4 else out4.squeeze(2)


@_op("lorc::latent_decode", mutates_args=())
def latent_decode(q: Tensor, c_k: Tensor, c_v: Tensor, scale: float,
                  mask: Tensor | None = None, start: Tensor | None = None,
                  length: Tensor | None = None, num_splits: int | None = None) -> Tensor:
    """Absorbed decode attention over a shared key/value latent (multi-query attention)."""
    q4, c_k, c_v = _check_common(q, c_k, c_v, mask, start, length)
    if q4.shape[-1] != c_k.shape[-1]:
        raise ValueError(f"q width {q4.shape[-1]} != key latent width {c_k.shape[-1]}")
    if _use_triton(q):
        out = latent_decode_triton(q4, c_k, c_v, scale, mask, start, length, num_splits)
    else:
        out = latent_decode_reference(q4, c_k, c_v, scale, mask, start, length,
                                      dtype=torch.float32).to(q.dtype)
    return _output(out, q)


@latent_decode.register_fake
def _latent_decode_fake(q, c_k, c_v, scale, mask=None, start=None, length=None,
                        num_splits=None):
    return q.new_empty(*q.shape[:-1], c_v.shape[-1])
