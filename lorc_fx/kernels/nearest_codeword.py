"""The nearest codeword of each sample, the step k-means and product-code encoding repeat:
the op ``lorc::nearest_codeword(x (S, n, d), codewords (S, K, d))`` is ``(S, n)`` int64, for
each sample of set ``s`` the index of the codeword of table ``s`` at the least squared
distance (an op, so that a vector-coded cache's writes trace into compiled graphs).

A C++ kernel for x86-64 CPUs (``nearest_codeword.cpp``, its header says why it is written by
hand; built once per machine by ``kernels.native``) serves CPU tensors of sub-vectors of
``KERNEL_DIMS`` channels (every width ``codes.vector.sub_dims`` gives); everywhere else tensor
maths computes the same in float32: the squared norms less twice the dot products, a batched
product, then the least.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor
from torch.library import custom_op

from .native import build

SOURCE = Path(__file__).with_name("nearest_codeword.cpp")
KERNEL_DIMS = (1, 2, 4, 8, 16)
CHUNK = 4096  # samples at a time in the tensor maths (their distances to every codeword)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build(SOURCE, "fitting and coding vector codes")
    if lib is None:
        return None
    lib.lorc_nearest.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    return lib


def native_applies(x: Tensor, codewords: Tensor) -> bool:
    """Whether the C++ kernel serves ``x`` against ``codewords`` (building it the first time
    this is asked on a CPU)."""
    return (x.device.type == "cpu" and codewords.device.type == "cpu"
            and x.shape[-1] in KERNEL_DIMS and _library() is not None)


def distance_terms(codewords: Tensor) -> tuple[Tensor, Tensor]:
    """``-2·c`` and ``|c|²`` of ``codewords (S, K, d)``, float32 and contiguous: a codeword's
    squared distance to ``x`` less ``|x|²`` is ``|c|² + Σ (-2c)·x``, what the kernels sum
    (``-2``: exact). A caller that assigns to the same codewords often keeps them."""
    books = codewords.float()
    return (-2 * books).contiguous(), (books ** 2).sum(-1).contiguous()


@custom_op("lorc::nearest_codeword", mutates_args=())
def nearest_codeword(x: Tensor, codewords: Tensor) -> Tensor:
    """Index of the nearest of ``codewords (S, K, d)`` to each of ``x (S, n, d)``: ``(S, n)``
    int64."""
    subs, n, d = x.shape
    if codewords.dim() != 3 or codewords.shape[0] != subs or codewords.shape[2] != d:
        raise ValueError(f"samples {tuple(x.shape)} take codewords of ({subs}, K, {d}), not "
                         f"{tuple(codewords.shape)}")
    x, books = x.float(), codewords.float()
    scaled, norms = distance_terms(books)
    if not native_applies(x, books):
        return torch.cat([torch.baddbmm(norms[:, None, :], part, scaled.transpose(1, 2))
                          .argmin(-1) for part in x.split(CHUNK, dim=1)], dim=1)
    rows = x.transpose(1, 2).contiguous()
    out = torch.empty(subs, n, dtype=torch.int64)
    if n == 0:
        return out
    if _library().lorc_nearest(rows.data_ptr(), scaled.data_ptr(), norms.data_ptr(),
                               out.data_ptr(), subs, n, d, books.shape[1],
                               torch.get_num_threads()):
        raise RuntimeError(f"lorc_nearest does not take sub-vectors of {d} channels")
    return out


@nearest_codeword.register_fake
def _nearest_codeword_fake(x, codewords):
    return x.new_empty(x.shape[:2], dtype=torch.int64)
