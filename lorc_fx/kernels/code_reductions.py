"""Decode attention over quantized cache codes, as ATen ops with a C++ kernel for x86-64 CPUs:
its two reductions, ``lorc::code_scores`` and ``lorc::code_sums``, and a plain plan's whole
step fused, ``lorc::code_attention`` (scores, softmax and weighted values in one pass over
the codes).

Layouts are ``lorc_fx.codes.integer``'s (codes unsigned, packed in runs: byte ``j`` holds
code ``j`` of each of the ``8 // bits`` runs of a group, the first run in the low bits; a value
is ``zero + code·scale``):

- ``code_scores(q, payload, scale, zero, bits)``: ``q (b, hk, m, w)`` against per-channel
  codes, payload ``(b, hk, w, groups, G·bits/8)``, scale/zero ``(b, hk, w, groups)``:
  ``(b, hk, m, groups·G)``, the score of every slot (unscaled);
- ``code_sums(p, payload, scale, zero, bits)``: weights ``p (b, hk, m, n)`` against
  per-token codes, payload ``(b, hk, n, cg, Gc·bits/8)``, scale/zero ``(b, hk, n, cg)``:
  ``(b, hk, m, cg·Gc)``, ``Σ_n p·value``;
- ``code_attention(q, k_payload, k_scale, k_zero, k_bits, v_payload, v_scale, v_zero, v_bits,
  k_window, v_window, bias, scale)``: decode attention of ``q (b, hk, m, d)`` over a plain
  plan's two sides: per-channel key codes over ``n`` slots and per-token value codes over the
  first ``n_v`` of them (the bias masks the rest), then the windows' rows ``(b, hk, rows, d)``;
  scores times ``scale`` plus ``bias (b, t, n + rows)`` (0 or -inf, or an additive mask: query
  row ``i`` of a kv head is query token ``i % t``), a softmax (a row with nothing to attend
  gets zeros), the values weighted: ``(b, hk, m, d)``.

Results are float32. The ops and their CPU kernels are defined in C++ (``code_reductions.cpp``:
its header says why by hand, and why not Python ops), built on first use against torch
(``kernels.native``: once per machine) for 8- or 4-bit codes in groups of a multiple of
``GROUP_MULTIPLE`` (``native_applies``, which the passes ask before they call an op). Where
the kernel cannot be built (no AVX2, no compiler: a warning says why, once) the ops do not
exist and the passes compute the same sums with tensor maths
(``compile.quantized_attention``).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from .native import build

SOURCE = Path(__file__).with_name("code_reductions.cpp")
NATIVE_BITS = (8, 4)
GROUP_MULTIPLE = 32  # a group splits into whole vectors of codes, for 4 bits in each half


@functools.cache
def _registered() -> bool:
    """Whether the ops are registered: the kernel built (the first time on this machine) and
    loaded, their shapes given for tracing."""
    if build(SOURCE, "decode attention over quantized codes", links_torch=True) is None:
        return False
    for name, fake in (("code_scores", _code_scores_fake), ("code_sums", _code_sums_fake),
                       ("code_attention", _code_attention_fake)):
        torch.library.register_fake(f"lorc::{name}", fake)
    return True


def native_applies(device: torch.device, bits: int, group: int) -> bool:
    """Whether the C++ kernel serves codes of ``bits`` in groups of ``group`` on ``device``
    (building it the first time this is asked on a CPU)."""
    return (device.type == "cpu" and bits in NATIVE_BITS and group % GROUP_MULTIPLE == 0
            and _registered())


def _code_scores_fake(q, payload, scale, zero, bits):
    return q.new_empty(*q.shape[:3], payload.shape[3] * payload.shape[4] * 8 // bits,
                       dtype=torch.float32)


def _code_sums_fake(p, payload, scale, zero, bits):
    return p.new_empty(*p.shape[:3], payload.shape[3] * payload.shape[4] * 8 // bits,
                       dtype=torch.float32)


def _code_attention_fake(q, k_payload, k_scale, k_zero, k_bits, v_payload, v_scale, v_zero,
                         v_bits, k_window, v_window, bias, scale):
    return q.new_empty(q.shape, dtype=torch.float32)
