"""Decode attention over quantized cache codes, as ops with a C++ kernel for x86-64 CPUs:
its two reductions, ``lorc::code_scores`` and ``lorc::code_sums``, and a plain plan's whole
step fused, ``lorc::code_attention`` (scores, softmax and weighted values in one pass over
the codes: its docstring).

Layouts are ``lorc_fx.codes.integer``'s (codes unsigned, packed in runs: byte ``j`` holds
code ``j`` of each of the ``8 // bits`` runs of a group, the first run in the low bits; a value
is ``zero + code·scale``):

- ``code_scores(q, payload, scale, zero, bits)``: ``q (b, hk, m, w)`` against per-channel
  codes, payload ``(b, hk, w, groups, G·bits/8)``, scale/zero ``(b, hk, w, groups)``:
  ``(b, hk, m, groups·G)``, the score of every slot (unscaled);
- ``code_sums(p, payload, scale, zero, bits)``: weights ``p (b, hk, m, n)`` against
  per-token codes, payload ``(b, hk, n, cg, Gc·bits/8)``, scale/zero ``(b, hk, n, cg)``:
  ``(b, hk, m, cg·Gc)``, ``Σ_n p·value``.

Results are float32. The C++ kernel (``code_reductions.cpp``, its header says why it is written
by hand) is built on first use (``kernels.native``: once per machine, loaded with ``ctypes``); it runs
on CPU tensors with 8- or 4-bit codes in groups of a multiple of ``GROUP_MULTIPLE``
(``native_applies``). Everywhere else the ops compute the same sums from the codes
dequantized (the reference: float32 tensor maths; 2-, 4- or 8-bit codes), as they do where the kernel cannot be
built (no AVX2, no compiler: a warning says why, once).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor
from torch.library import custom_op

from .native import build

SOURCE = Path(__file__).with_name("code_reductions.cpp")
NATIVE_BITS = (8, 4)
GROUP_MULTIPLE = 32  # a group splits into whole vectors of codes, for 4 bits in each half
ROWS = 3  # query rows of the kernel's register tile (its work buffers hold whole tiles)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (``kernels.native``); None where it cannot be built (then the ops
    use the reference)."""
    lib = build(SOURCE, "decode attention over quantized codes")
    if lib is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("lorc_code_scores", "lorc_code_sums"):
        getattr(lib, name).argtypes = [pointer] * 6 + [size] * 6 + [ctypes.c_int]
    lib.lorc_code_attention.argtypes = ([pointer] * 12 + [size] * 13 + [ctypes.c_float]
                                        + [ctypes.c_int])
    return lib


def native_applies(device: torch.device, bits: int, group: int) -> bool:
    """Whether the C++ kernel serves codes of ``bits`` in groups of ``group`` on ``device``
    (building it the first time this is asked on a CPU)."""
    return (device.type == "cpu" and bits in NATIVE_BITS and group % GROUP_MULTIPLE == 0
            and _library() is not None)


def _codes(payload: Tensor, bits: int) -> Tensor:
    """Packed codes ``(..., bytes)`` as float32 ``(..., bytes·8/bits)`` in order. Only widths
    that divide a byte unpack by shifts (``codes.integer.unpack_bits``, a layer above, reads 3-bit
    words); the ops take no others."""
    if 8 % bits:
        raise ValueError(f"lorc::code_* ops read codes of 2, 4 or 8 bits, not {bits}")
    runs = [(payload >> (bits * i)) & ((1 << bits) - 1) for i in range(8 // bits)]
    return torch.cat(runs, dim=-1).float()


def _values(payload: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """Codes dequantized: the group axis flattened with its codes, ``(..., groups·G)``."""
    codes = _codes(payload, bits)
    return (zero.float()[..., None] + codes * scale.float()[..., None]).flatten(-2)


@custom_op("lorc::code_scores", mutates_args=())
def code_scores(q: Tensor, payload: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """``q (b, hk, m, w)`` against every slot of per-channel codes: ``(b, hk, m, groups·G)``."""
    b, hk, m, w = q.shape
    groups, group = payload.shape[3], payload.shape[4] * 8 // bits
    if not native_applies(q.device, bits, group):
        return torch.einsum("bhmw,bhwn->bhmn", q.float(), _values(payload, scale, zero, bits))
    q, payload = q.float().contiguous(), payload.contiguous()
    scale, zero = scale.float().contiguous(), zero.float().contiguous()
    out = q.new_empty(b, hk, m, groups * group)
    threads = torch.get_num_threads()
    work = q.new_empty(threads * (w + 1) * ROWS, dtype=torch.float32)
    _library().lorc_code_scores(*map(Tensor.data_ptr, (q, payload, scale, zero, out, work)),
                                b * hk, m, w, groups, group, bits, threads)
    return out


@custom_op("lorc::code_sums", mutates_args=())
def code_sums(p: Tensor, payload: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """``Σ_n p·value`` over per-token codes for weights ``p (b, hk, m, n)``:
    ``(b, hk, m, cg·Gc)``."""
    b, hk, m, n = p.shape
    channel_groups, group = payload.shape[3], payload.shape[4] * 8 // bits
    if not native_applies(p.device, bits, group):
        return p.float() @ _values(payload, scale, zero, bits)
    p, payload = p.float().contiguous(), payload.contiguous()
    scale, zero = scale.float().contiguous(), zero.float().contiguous()
    out = p.new_empty(b, hk, m, channel_groups * group)
    zeros = p.new_zeros(n)  # the weights of the rows past m in the last tile
    _library().lorc_code_sums(*map(Tensor.data_ptr, (p, payload, scale, zero, out, zeros)),
                              b * hk, m, n, channel_groups, group, bits, torch.get_num_threads())
    return out


@code_scores.register_fake
def _code_scores_fake(q, payload, scale, zero, bits):
    return q.new_empty(*q.shape[:3], payload.shape[3] * payload.shape[4] * 8 // bits,
                       dtype=torch.float32)


@code_sums.register_fake
def _code_sums_fake(p, payload, scale, zero, bits):
    return p.new_empty(*p.shape[:3], payload.shape[3] * payload.shape[4] * 8 // bits,
                       dtype=torch.float32)


@custom_op("lorc::code_attention", mutates_args=())
def code_attention(q: Tensor, k_payload: Tensor, k_scale: Tensor, k_zero: Tensor, k_bits: int,
                   v_payload: Tensor, v_scale: Tensor, v_zero: Tensor, v_bits: int,
                   k_window: Tensor, v_window: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Decode attention of ``q (b, hk, m, d)`` over a plain plan's two sides, fused: per-channel
    key codes over ``n`` slots and per-token value codes over the first ``n_v`` of them (the
    bias masks the rest), then the windows' rows ``(b, hk, rows, d)``; scores times ``scale``
    plus ``bias (b, t, n + rows)`` (0 or -inf, or an additive mask: query row ``i`` of a kv
    head is query token ``i % t``), a softmax (a row with nothing to attend gets zeros), the
    values weighted: ``(b, hk, m, d)`` float32."""
    b, hk, m, d = q.shape
    groups, group = k_payload.shape[3], k_payload.shape[4] * 8 // k_bits
    channel_groups, value_group = v_payload.shape[3], v_payload.shape[4] * 8 // v_bits
    t, rows, value_slots = bias.shape[1], k_window.shape[2], v_payload.shape[2]
    if not (native_applies(q.device, k_bits, group)
            and native_applies(q.device, v_bits, value_group)):
        scores = torch.cat([code_scores(q, k_payload, k_scale, k_zero, k_bits),
                            q.float() @ k_window.float().transpose(-1, -2)], dim=-1)
        scores = scores * scale + bias.float().repeat(1, m // t, 1).unsqueeze(1)
        probs = torch._safe_softmax(scores, -1)
        n = groups * group
        return (code_sums(probs[..., :value_slots], v_payload, v_scale, v_zero, v_bits)[..., :d]
                + probs[..., n:] @ v_window.float())
    tensors = [x.contiguous() for x in (q.float(), k_payload, k_scale.float(), k_zero.float(),
                                        v_payload, v_scale.float(), v_zero.float(),
                                        k_window.float(), v_window.float(), bias.float())]
    out = q.new_empty(b, hk, m, d, dtype=torch.float32)
    threads = torch.get_num_threads()
    work = q.new_empty(threads * ROWS * (groups * group + rows + d + 1
                                         + channel_groups * value_group), dtype=torch.float32)
    _library().lorc_code_attention(*map(Tensor.data_ptr, (*tensors, out, work)), b, hk, m, t, d,
                                   groups, group, k_bits, value_slots, channel_groups,
                                   value_group, v_bits, rows, scale, threads)
    return out


@code_attention.register_fake
def _code_attention_fake(q, k_payload, k_scale, k_zero, k_bits, v_payload, v_scale, v_zero,
                         v_bits, k_window, v_window, bias, scale):
    return q.new_empty(q.shape, dtype=torch.float32)
