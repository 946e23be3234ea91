"""Triton flash-decoding over a low-rank KV latent (absorbed mode).

All ``H`` query heads of a batch row share one key latent and one value latent (multi-query
attention), so one program loads each latent tile once and scores it for every head: the
``H * T`` query rows form the M dimension of ``tl.dot`` (padded to at least 16). The sequence is
split across programs (flash-decoding); each split writes a partial ``(max, sum, acc)`` in float32
and :func:`_combine_splits_kernel` merges them. With one split the first kernel writes the output.

Register budget: the output accumulator is ``BLOCK_M x BLOCK_V`` float32. For wide value latents
the ``r_v`` columns are split over a third grid axis (capped at ``_ACC_ELEMS`` elements), which
re-reads the key latent once per extra chunk; the scores loop over ``r_k`` in ``BLOCK_K`` chunks.
Block sizes and the split count are heuristics, not tuned: no GPU was available when this was
written, so none of these choices is measured (``bench/decode_attention.py`` measures them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

LOG2E = 1.4426950408889634
_ACC_ELEMS = 16384  # float32 accumulator elements per program (BLOCK_M * BLOCK_V)


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b``. ``UPCAST`` works around the Triton interpreter, whose ``tl.dot`` multiplies
    bfloat16 operands as raw uint16 bits; the upcast is exact, so the result is unchanged."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def visible_keys(offs_n, n_hi, b, tq, kv_end, mask_ptr, stride_mb, stride_mn,
                 T: tl.constexpr, HAS_MASK: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` visibility of keys ``offs_n`` for query rows at token ``tq``."""
    n_ok = offs_n < n_hi
    visible = n_ok[None, :] & (tq >= 0)[:, None]  # (tq >= 0) only broadcasts to 2-D
    if HAS_MASK:
        keep = tl.load(mask_ptr + b * stride_mb + offs_n * stride_mn, mask=n_ok, other=0)
        visible = visible & (keep != 0)[None, :]
    if T > 1:
        visible = visible & (offs_n[None, :] <= (kv_end - T + tq)[:, None])
    return visible


@triton.jit
def softmax_step(s, visible, m_i, l_i, acc, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax update in the log2 domain (``s`` already scaled by ``scale*log2 e``).

    Rows with no visible key so far keep ``m = -inf``, ``l = 0``, ``acc = 0`` (no NaN)."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
    return m_new, l_i, acc


@triton.jit
def split_range(b, split, split_len, N, start_ptr, length_ptr, HAS_RANGE: tl.constexpr):
    """Token range ``[lo, hi)`` of this split, clipped to the row's visible range, and the end of
    that range (the causal anchor for ``T > 1``)."""
    lo = split * split_len
    hi = tl.minimum(lo + split_len, N)
    kv_end = N
    if HAS_RANGE:
        kv_start = tl.load(start_ptr + b)
        kv_end = kv_start + tl.load(length_ptr + b)
        lo = tl.maximum(lo, kv_start)
        hi = tl.minimum(hi, kv_end)
    return lo, hi, kv_end


@triton.jit
def store_result(acc, m_i, l_i, b, split, vc, rows, head, tq, offs_v, row_ok, v_ok, HT, R_V,
                 out_ptr, stride_ob, stride_oh, stride_ot, stride_or, m_ptr, l_ptr, acc_ptr,
                 SINGLE_SPLIT: tl.constexpr):
    """Write the normalised output (one split) or this split's float32 partial."""
    if SINGLE_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = (out_ptr + b * stride_ob + head[:, None] * stride_oh + tq[:, None] * stride_ot
                + offs_v[None, :] * stride_or)
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    else:
        part = (b * tl.num_programs(1) + split) * HT + rows
        tl.store(acc_ptr + part[:, None] * R_V + offs_v[None, :], acc,
                 mask=row_ok[:, None] & v_ok[None, :])
        if vc == 0:
            tl.store(m_ptr + part, m_i, mask=row_ok)
            tl.store(l_ptr + part, l_i, mask=row_ok)


@triton.jit
def _latent_split_kernel(
    q_ptr, ck_ptr, cv_ptr, mask_ptr, start_ptr, length_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    H, N, R_K, R_V, qk_scale, split_len,
    stride_qb, stride_qh, stride_qt, stride_qr,
    stride_kb, stride_kn, stride_kr,
    stride_vb, stride_vn, stride_vr,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_or,
    T: tl.constexpr, HAS_MASK: tl.constexpr, HAS_RANGE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    vc = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < H * T
    head = rows // T
    tq = rows % T
    offs_v = vc * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < R_V
    lo, hi, kv_end = split_range(b, split, split_len, N, start_ptr, length_ptr, HAS_RANGE)

    q_rows = q_ptr + b * stride_qb + head * stride_qh + tq * stride_qt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, R_K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < R_K
            q = tl.load(q_rows[:, None] + offs_k[None, :] * stride_qr,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            k_t = tl.load(ck_ptr + b * stride_kb + offs_n[None, :] * stride_kn
                          + offs_k[:, None] * stride_kr,
                          mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            s = mma(q, k_t, s, UPCAST, PRECISION)
        visible = visible_keys(offs_n, hi, b, tq, kv_end, mask_ptr, stride_mb, stride_mn,
                               T, HAS_MASK)
        v = tl.load(cv_ptr + b * stride_vb + offs_n[:, None] * stride_vn
                    + offs_v[None, :] * stride_vr,
                    mask=n_ok[:, None] & v_ok[None, :], other=0.0)
        # Inductor passes a Python float to a user kernel as fp64 on GPUs that have it: the
        # softmax state stays float32 (an fp64 scale would turn m_i, l_i, acc fp64 in the loop).
        s = (s * qk_scale).to(tl.float32)
        m_i, l_i, acc = softmax_step(s, visible, m_i, l_i, acc, v, UPCAST, PRECISION)

    store_result(acc, m_i, l_i, b, split, vc, rows, head, tq, offs_v, row_ok, v_ok, H * T, R_V,
                 out_ptr, stride_ob, stride_oh, stride_ot, stride_or, m_ptr, l_ptr, acc_ptr,
                 SINGLE_SPLIT)


@triton.jit
def _combine_splits_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, S, HT, R_V,
    stride_ob, stride_oh, stride_ot, stride_or,
    T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Merge the per-split partials of one query row (program axis 1) of one batch row."""
    b = tl.program_id(0)
    row = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    part = (b * S + offs_s) * HT + row
    m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
    row_sum = tl.load(l_ptr + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    den = tl.sum(row_sum * w, 0)
    den = tl.where(den == 0.0, 1.0, den)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < R_V
    acc = tl.load(acc_ptr + part[:, None] * R_V + offs_v[None, :],
                  mask=s_ok[:, None] & v_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / den
    ptrs = (out_ptr + b * stride_ob + (row // T) * stride_oh + (row % T) * stride_ot
            + offs_v * stride_or)
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=v_ok)


@dataclass(frozen=True)
class SplitPlan:
    """How the sequence is cut: ``num_splits`` programs of ``split_len`` tokens each."""

    num_splits: int
    split_len: int


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(device: torch.device, batch: int, n: int, programs_per_split: int,
                block_n: int, num_splits: int | None) -> SplitPlan:
    """Enough splits to give every SM about two programs, never more splits than tiles."""
    tiles = max(1, triton.cdiv(n, block_n))
    if num_splits is None:
        sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
        num_splits = triton.cdiv(2 * sms, batch * programs_per_split)
    num_splits = max(1, min(num_splits, tiles))
    tiles_per_split = triton.cdiv(tiles, num_splits)
    return SplitPlan(triton.cdiv(tiles, tiles_per_split), tiles_per_split * block_n)


def strides(prefix: str, dims: str, t: torch.Tensor) -> dict:
    """``stride_<prefix><dim>`` keyword arguments, e.g. ``stride_qb``."""
    return {f"stride_{prefix}{d}": st for d, st in zip(dims, t.stride(), strict=True)}


def block_rows(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def block_cols(width: int, cap: int) -> int:
    return max(16, min(triton.next_power_of_2(width), cap))


def dot_flags(dtype: torch.dtype) -> tuple[bool, str | None]:
    """``(UPCAST, PRECISION)``: exact float32 products for float32 inputs (no TF32)."""
    upcast = dtype == torch.bfloat16 and triton.knobs.runtime.interpret
    return upcast, ("ieee" if dtype == torch.float32 else None)


def range_args(mask, start, length, n: int) -> dict:
    """Kernel keyword arguments for the optional mask and ``start``/``length`` (absent ones are
    passed as ``None``: their constexpr flag is off and they are never read)."""
    has_range = start is not None or length is not None
    if has_range:
        start = torch.zeros_like(length) if start is None else start
        length = n - start if length is None else length
    return dict(mask_ptr=mask, start_ptr=start, length_ptr=length,
                stride_mb=0 if mask is None else mask.stride(0),
                stride_mn=0 if mask is None else mask.stride(1),
                HAS_MASK=mask is not None, HAS_RANGE=has_range)


def split_buffers(out: torch.Tensor, batch: int, plan: SplitPlan, rows: int, r_v: int) -> dict:
    """Float32 partials ``m``, ``l`` ``(B, S, rows)`` and ``acc`` ``(B, S, rows, r_v)``; none with
    a single split, where the kernel writes ``out`` directly."""
    if plan.num_splits == 1:
        return dict(m_ptr=None, l_ptr=None, acc_ptr=None)
    opts = dict(device=out.device, dtype=torch.float32)
    s = plan.num_splits
    return dict(m_ptr=torch.empty(batch, s, rows, **opts),
                l_ptr=torch.empty(batch, s, rows, **opts),
                acc_ptr=torch.empty(batch, s, rows, r_v, **opts))


def combine_splits(parts: dict, out: torch.Tensor, t: int) -> None:
    acc = parts["acc_ptr"]
    batch, s, rows, r_v = acc.shape
    block_v = block_cols(r_v, 1024)
    grid = (batch, rows, triton.cdiv(r_v, block_v))
    wrap_triton(_combine_splits_kernel)[grid](
        parts["m_ptr"], parts["l_ptr"], acc, out, s, rows, r_v, *out.stride(),
        T=t, BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_V=block_v)


@dataclass(frozen=True)
class DecodeLaunch:
    """Tiling, split plan, output and partial buffers of one decode launch."""

    out: torch.Tensor
    parts: dict
    plan: SplitPlan
    grid: tuple
    t: int
    blocks: dict  # BLOCK_M / BLOCK_N / BLOCK_K / BLOCK_V
    upcast: bool
    precision: str | None

    @classmethod
    def prepare(cls, q, n: int, r_k: int, r_v: int, block_k_cap: int,
                num_splits: int | None) -> "DecodeLaunch":
        batch, heads, t, _ = q.shape
        rows = heads * t
        block_m = block_rows(rows)
        block_v = block_cols(r_v, max(16, _ACC_ELEMS // block_m))
        blocks = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_cols(r_k, block_k_cap),
                      BLOCK_V=block_v)
        v_chunks = triton.cdiv(r_v, block_v)
        plan = plan_splits(q.device, batch, n, v_chunks, blocks["BLOCK_N"], num_splits)
        out = torch.empty(batch, heads, t, r_v, device=q.device, dtype=q.dtype)
        upcast, precision = dot_flags(q.dtype)
        return cls(out, split_buffers(out, batch, plan, rows, r_v), plan,
                   (batch, plan.num_splits, v_chunks), t, blocks, upcast, precision)

    def kernel_args(self) -> dict:
        return dict(out_ptr=self.out, **self.parts, split_len=self.plan.split_len,
                    **strides("o", "bhtr", self.out), T=self.t,
                    SINGLE_SPLIT=self.plan.num_splits == 1, UPCAST=self.upcast,
                    PRECISION=self.precision, **self.blocks)

    def finish(self) -> torch.Tensor:
        if self.plan.num_splits > 1:
            combine_splits(self.parts, self.out, self.t)
        return self.out


def latent_decode_triton(q, c_k, c_v, scale: float, mask=None, start=None, length=None,
                         num_splits: int | None = None) -> torch.Tensor:
    """Launch on validated inputs: ``q`` ``(B, H, T, r_k)``, ``c_k`` ``(B, N, r_k)``, ``c_v``
    ``(B, N, r_v)``, any strides. Returns ``(B, H, T, r_v)`` in ``q.dtype``."""
    heads, r_k = q.shape[1], q.shape[3]
    n, r_v = c_k.shape[1], c_v.shape[2]
    launch = DecodeLaunch.prepare(q, n, r_k, r_v, 128, num_splits)
    wide = launch.blocks["BLOCK_M"] * launch.blocks["BLOCK_V"] >= 8192
    wrap_triton(_latent_split_kernel)[launch.grid](
        q_ptr=q, ck_ptr=c_k, cv_ptr=c_v, **launch.kernel_args(),
        **range_args(mask, start, length, n), H=heads, N=n, R_K=r_k, R_V=r_v,
        qk_scale=scale * LOG2E, **strides("q", "bhtr", q), **strides("k", "bnr", c_k),
        **strides("v", "bnr", c_v), num_warps=8 if wide else 4)
    return launch.finish()
