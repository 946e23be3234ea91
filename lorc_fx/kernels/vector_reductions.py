"""Decode attention's two reductions over product vector codes (``codes.vector``), as ops with a
C++ kernel for x86-64 CPUs that reads the codes and never writes the latent to memory:

- ``vector_scores(q, payload, tables)``: ``q (b, m, r)`` against every slot of a side's codes
  (each run's packed indices ``(b, S, blocks·index bytes)``, its reconstructions ``(S, K, d)``):
  ``(b, m, blocks·BLOCK)``, unscaled. The kernel builds each query row's table of dot products
  with every codeword once a step; a slot's score is then one lookup a sub-vector.
- ``vector_sums(p, payload, tables)``: weights ``p (b, m, blocks·BLOCK)`` over every slot:
  ``Σ_slot p·latent``, ``(b, m, r)``: each block of 8 slots decoded into L1 and added in,
  weighted (on CUDA, Triton's: the weights added into per-codeword sums, then one small
  product with the tables). Sub-vectors of 1, 2, 4, 8 or 16 channels (``DECODED_DIMS``: all
  that ``codes.vector`` makes).

The same C++ file decodes a side's latents (:func:`decoded`, the body of
``lorc::vector_decode`` on CPUs) and writes a static store's new tokens (:func:`rewritten`,
the body of ``lorc::vector_rewritten``): each token's nearest codewords packed into its
blocks, in a call instead of a few dozen small tensor ops a run (measured 100 ms of a 390 ms
decode step of the default model's 2.56-bit plan at 4096 tokens).

Results are float32. On CPUs the C++ kernel (``vector_reductions.cpp``) is built on first use
(``kernels.native``: once per machine, loaded with ``ctypes``); on CUDA tensors the ops run
Triton kernels (``kernels.vector_triton``) where Triton is installed. The ops run where one of
them serves (``native_applies``); elsewhere (other CPUs, or where the C++ kernel cannot be
built) their caller decodes the codes and multiplies: the same sums in another order.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor
from torch.library import custom_op

from . import nearest_codeword
from .native import build

try:
    from . import vector_triton
except ImportError as error:  # Triton is optional: then CUDA tensors decode and multiply
    if error.name != "triton":
        raise
    vector_triton = None

SOURCE = Path(__file__).with_name("vector_reductions.cpp")
BLOCK = 8  # tokens whose indices pack together (``codes.vector.BLOCK``; a test checks)
DECODED_DIMS = (1, 2, 4, 8, 16)  # sub-vector lengths the decode kernel copies (``sub_dims``')


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib``'s kernels given their C signatures (this file's or another version's: bench)."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("lorc_vector_scores", "lorc_vector_sums"):
        getattr(lib, name).argtypes = [pointer] * 6 + [size] * 5 + [pointer] * 2 + [ctypes.c_int]
    lib.lorc_vector_rewrite.argtypes = [pointer] * 8 + [size] * 7
    lib.lorc_vector_decode.argtypes = [pointer] * 5 + [size] * 4 + [pointer, ctypes.c_int]
    lib.lorc_vector_turned_scores.argtypes = ([pointer] * 4 + [size] + [pointer] * 5 + [size] * 5
                                              + [pointer, ctypes.c_int])
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel; None where it cannot be built (then callers decode and multiply)."""
    lib = build(SOURCE, "decode attention over vector codes")
    if lib is None:
        return None
    lib.lorc_vector_scores_work.argtypes = [ctypes.c_int64] * 3
    lib.lorc_vector_scores_work.restype = ctypes.c_int64
    return _typed(lib)


def native_applies(device: torch.device) -> bool:
    """Whether a kernel serves codes on ``device``: Triton's on CUDA, the C++ one on a CPU
    (built the first time this is asked)."""
    if device.type == "cuda":
        return vector_triton is not None
    return device.type == "cpu" and _library() is not None


def _served(x: Tensor, op: str) -> None:
    if not native_applies(x.device):
        raise RuntimeError(f"lorc::{op} runs where a kernel does (x86-64 CPUs; CUDA with "
                           f"Triton installed): elsewhere decode the codes and multiply")


@functools.lru_cache(maxsize=None)
def _layout(shapes: tuple[torch.Size, ...]) -> tuple:
    """A book's layout from its tables' shapes ``(S, K, d)``, as the kernel takes it: the
    sub-vectors, channels and index bits of each run (``ctypes`` arrays), the latent's width,
    the entries ``Σ S·K`` and the first run's index bits. Cached: a model's books are few and
    a decode step asks for each many times."""
    runs = [(subs, d, count.bit_length() - 1) for subs, count, d in shapes]
    array = lambda values: (ctypes.c_int64 * len(values))(*values)  # noqa: E731
    return (array([r[0] for r in runs]), array([r[1] for r in runs]), array([r[2] for r in runs]),
            sum(subs * d for subs, d, _ in runs), sum(s[0] * s[1] for s in shapes), runs[0][2])


def _shapes(tables: list[Tensor]) -> tuple[torch.Size, ...]:
    return tuple(torch.Size(int(n) for n in t.shape) for t in tables)  # a book: never symbolic


def _pointers(tensors: list[Tensor]):
    """The tensors' data pointers as a ``ctypes`` array (a kernel's per-run arguments)."""
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _operands(payload: list[Tensor], tables: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The codes and float32 tables, contiguous, as the kernels read them."""
    return [p.contiguous() for p in payload], [t.float().contiguous() for t in tables]


def _decodes(tables: list[Tensor]) -> bool:
    """Whether the kernel's decode copies every run's sub-vectors (``DECODED_DIMS``)."""
    return all(t.shape[2] in DECODED_DIMS for t in tables)


def _call(name: str, x: Tensor, payload: list[Tensor], tables: list[Tensor], out: Tensor
          ) -> Tensor:
    """Run kernel ``name`` on ``x (b, m, ·)`` and the codes into ``out``."""
    b, m = x.shape[:2]
    subs, dims, ibits, width, entries, first_bits = _layout(_shapes(tables))
    payload, tables = _operands(payload, tables)
    threads = torch.get_num_threads()
    # the scores' table of each entry's dot products with the query rows (its size the
    # kernel's to say), or each thread's sums
    work = x.new_empty(_library().lorc_vector_scores_work(b, m, entries)
                       if name == "lorc_vector_scores" else b * threads * m * width)
    getattr(_library(), name)(
        x.data_ptr(), _pointers(payload), _pointers(tables), subs, dims, ibits, len(tables), b, m,
        width, payload[0].shape[-1] // first_bits, out.data_ptr(), work.data_ptr(), threads)
    return out


def _blocks(payload: list[Tensor], tables: list[Tensor]) -> int:
    return payload[0].shape[-1] // _layout(_shapes(tables))[5]


def _width(tables: list[Tensor]) -> int:
    return _layout(_shapes(tables))[3]


def rewritten(payload: list[Tensor], z: Tensor, scaled: list[Tensor], norms: list[Tensor],
              start: int, staged: int) -> list[Tensor] | None:
    """``lorc::vector_rewritten``'s blocks by the kernel (its docstring): each run's ``staged``
    blocks ``(b, S, staged, index bytes)`` from block ``start // BLOCK`` of ``payload`` ``(b,
    S, blocks, index bytes)``, the indices of ``z (b, t, r)``'s tokens packed in from
    ``start``, each the nearest codeword (``scaled``, ``norms``: each run's
    ``nearest_codeword.distance_terms``) as ``lorc::nearest_codeword`` picks it. None where
    the kernels do not serve (then the op computes them with tensor maths)."""
    if not (native_applies(z.device)
            and all(nearest_codeword.native_applies(c, c) for c in scaled)):
        return None
    subs, dims, ibits, _, _, _ = _layout(_shapes(scaled))
    payload = [p.contiguous() for p in payload]
    out = [p.new_empty(p.shape[0], p.shape[1], staged, p.shape[3]) for p in payload]
    z = z.float().contiguous()
    b, t, r = z.shape
    _library().lorc_vector_rewrite(z.data_ptr(), _pointers(scaled), _pointers(norms),
                                   _pointers(payload), _pointers(out), subs, dims, ibits,
                                   len(scaled), b, t, r, payload[0].shape[2], start, staged)
    return out


def decoded(payload: list[Tensor], tables: list[Tensor]) -> Tensor | None:
    """``lorc::vector_decode``'s latents ``(b, blocks·BLOCK, r)`` by the kernel, float32: each
    slot's reconstructions copied from ``tables`` (the same floats as the op's tensor maths,
    which unpack and gather run by run: ~60 ms of a 400 ms decode step of the default
    model's 2.56-bit plan at 4096 tokens). None where the kernel does not serve."""
    if payload[0].device.type != "cpu" or _library() is None or not _decodes(tables):
        return None
    subs, dims, ibits, width, _, _ = _layout(_shapes(tables))
    blocks, b = _blocks(payload, tables), payload[0].shape[0]
    payload, tables = _operands(payload, tables)
    out = tables[0].new_empty(b, blocks * BLOCK, width)
    _library().lorc_vector_decode(_pointers(payload), _pointers(tables), subs, dims, ibits,
                                  len(tables), b, width, blocks, out.data_ptr(),
                                  torch.get_num_threads())
    return out


@custom_op("lorc::vector_scores", mutates_args=())
def vector_scores(q: Tensor, payload: list[Tensor], tables: list[Tensor]) -> Tensor:
    """``q (b, m, r)`` against every slot of product codes: ``(b, m, blocks·BLOCK)``."""
    _served(q, "vector_scores")
    b, m, _ = q.shape
    out = q.new_empty(b, m, _blocks(payload, tables) * BLOCK, dtype=torch.float32)
    return _call("lorc_vector_scores", q.float().contiguous(), payload, tables, out)


@custom_op("lorc::vector_sums", mutates_args=())
def vector_sums(p: Tensor, payload: list[Tensor], tables: list[Tensor]) -> Tensor:
    """``Σ_slot p·latent`` for weights ``p (b, m, blocks·BLOCK)``: ``(b, m, r)``."""
    _served(p, "vector_sums")
    if not _decodes(tables):  # on CPUs (CUDA tensors go to the Triton kernel)
        raise ValueError(f"lorc::vector_sums decodes sub-vectors of {DECODED_DIMS} channels, "
                         f"not {sorted({int(t.shape[2]) for t in tables})}")
    b, m, _ = p.shape
    out = p.new_empty(b, m, _width(tables), dtype=torch.float32)
    return _call("lorc_vector_sums", p.float().contiguous(), payload, tables, out)


@custom_op("lorc::vector_turned_scores", mutates_args=())
def vector_turned_scores(ab: Tensor, cos: Tensor, sin: Tensor, pairs: Tensor,
                         payload: list[Tensor], tables: list[Tensor]) -> Tensor:
    """Scores of keys cached before RoPE in a RoPE-commuting basis, read from their codes:
    ``ab (b, m, 2r)`` each query row's ``(α, β)`` (``compile.latent_attention.
    per_frequency_scores``), ``cos``/``sin`` ``(b, blocks·BLOCK, P)`` each slot's angle table
    (one value a rotary pair), ``pairs (r,)`` each latent channel's pair, int32 (a tensor: a
    list of ints costs the dispatcher ~55 µs a call to convert): ``(b, m, blocks·BLOCK)``,
    unscaled. C++ only (x86-64 CPUs, sub-vectors of ``DECODED_DIMS``: ``turned_applies``)."""
    if not turned_applies(ab.device, tables):
        raise RuntimeError("lorc::vector_turned_scores runs on x86-64 CPUs where the C++ kernel "
                           f"builds, over sub-vectors of {DECODED_DIMS} channels")
    b, m, _ = ab.shape
    subs, dims, ibits, width, _, _ = _layout(_shapes(tables))
    blocks = _blocks(payload, tables)
    payload, tables = _operands(payload, tables)
    ab, cos, sin = (x.float().contiguous() for x in (ab, cos, sin))
    if pairs.shape != (width,):
        raise ValueError(f"lorc::vector_turned_scores takes one rotary pair a latent channel: "
                         f"pairs of shape ({width},), not {tuple(pairs.shape)}")
    pair = pairs.to(torch.int32).contiguous()
    out = ab.new_empty(b, m, blocks * BLOCK)
    _library().lorc_vector_turned_scores(
        ab.data_ptr(), cos.data_ptr(), sin.data_ptr(), pair.data_ptr(), cos.shape[-1],
        _pointers(payload), _pointers(tables), subs, dims, ibits, len(tables), b, m, width,
        blocks, out.data_ptr(), torch.get_num_threads())
    return out


def turned_applies(device: torch.device, tables: list[Tensor]) -> bool:
    """Whether ``lorc::vector_turned_scores``' C++ kernel serves these codes on ``device``."""
    return device.type == "cpu" and _library() is not None and _decodes(tables)


@vector_turned_scores.register_fake
def _(ab, cos, sin, pairs, payload, tables):
    return ab.new_empty(*ab.shape[:2], _blocks(payload, tables) * BLOCK, dtype=torch.float32)


if vector_triton is not None:
    vector_scores.register_kernel("cuda")(vector_triton.scores)
    vector_sums.register_kernel("cuda")(vector_triton.sums)


@vector_scores.register_fake
def _(q, payload, tables):
    return q.new_empty(*q.shape[:2], _blocks(payload, tables) * BLOCK, dtype=torch.float32)


@vector_sums.register_fake
def _(p, payload, tables):
    return p.new_empty(*p.shape[:2], _width(tables), dtype=torch.float32)
