"""Triton flash-decoding for reconstruct mode (keys cached as a pre-RoPE latent).

Per key tile the program loads the key latent ``c_k`` once, rebuilds the keys of every kv head
``j`` as ``B_j c_k`` with ``B_j = P_k[:, j*d:(j+1)*d]^T``, rotates them at the tokens' cached
positions (rotate_half layout over the first ``rotary_dim`` dims) and scores them against the
(already rotated) queries of that head's group. The rebuild is computed transposed (``k^T =
B_j c^T``, shape ``[d, BLOCK_N]``) in three column groups of the basis: the two rotary halves and
the pass-through dims, so the rotation is elementwise and needs no register shuffles. The latent
tile comes from HBM once; its re-reads for each kv head and ``r_k`` chunk hit L1/L2. Scores of
all heads form one ``[BLOCK_M, BLOCK_N]`` tile (each group's dot uses the queries of that group,
other rows zeroed), so the softmax and the value-latent accumulation are the same as in
:mod:`lorc_fx.kernels.latent_decode`.

Cost: ``N * r_k * h_kv * d`` multiply-adds per query step for the rebuild, the basis is streamed
from L2 once per tile and kv head. Unmeasured (no GPU in the session that wrote it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .latent_decode import (
    LOG2E, DecodeLaunch, block_cols, mma, range_args, softmax_step, split_range, store_result,
    strides, visible_keys,
)


@triton.jit
def _basis_cols_t(basis_ptr, offs_k, k_ok, col0, width, stride_pr, stride_pf,
                  BLOCK_D: tl.constexpr):
    """``[BLOCK_D, BLOCK_K]``: basis columns ``col0 .. col0+width`` (zero past ``width``),
    transposed."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(basis_ptr + offs_k[None, :] * stride_pr + (col0 + offs_d)[:, None] * stride_pf,
                   mask=(offs_d < width)[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _load_query_cols(q_rows, stride_qr, row_ok, col0, width, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(q_rows[:, None] + (col0 + offs_d)[None, :] * stride_qr,
                   mask=row_ok[:, None] & (offs_d < width)[None, :], other=0.0)


@triton.jit
def _reconstruct_split_kernel(
    q_ptr, ck_ptr, cv_ptr, basis_ptr, pos_ptr, inv_freq_ptr, mask_ptr, start_ptr, length_ptr,
    out_ptr, m_ptr, l_ptr, acc_ptr,
    H, H_KV, N, R_K, R_V, qk_scale, split_len,
    stride_qb, stride_qh, stride_qt, stride_qr,
    stride_kb, stride_kn, stride_kr,
    stride_vb, stride_vn, stride_vr,
    stride_pr, stride_pf,
    stride_posb, stride_posn,
    stride_mb, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_or,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    T: tl.constexpr, HAS_MASK: tl.constexpr, HAS_RANGE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    PASS: tl.constexpr = HEAD_DIM - 2 * HALF
    b = tl.program_id(0)
    split = tl.program_id(1)
    vc = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < H * T
    head = rows // T
    tq = rows % T
    group = head // (H // H_KV)
    offs_v = vc * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < R_V
    lo, hi, kv_end = split_range(b, split, split_len, N, start_ptr, length_ptr, HAS_RANGE)

    q_rows = q_ptr + b * stride_qb + head * stride_qh + tq * stride_qt
    q_lo = _load_query_cols(q_rows, stride_qr, row_ok, 0, HALF, BLOCK_HALF)
    q_hi = _load_query_cols(q_rows, stride_qr, row_ok, HALF, HALF, BLOCK_HALF)
    if PASS > 0:
        q_pass = _load_query_cols(q_rows, stride_qr, row_ok, 2 * HALF, PASS, BLOCK_PASS)
    offs_f = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_f, mask=offs_f < HALF, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        pos = tl.load(pos_ptr + b * stride_posb + offs_n * stride_posn, mask=n_ok, other=0)
        angle = inv_freq[:, None] * pos.to(tl.float32)[None, :]  # [BLOCK_HALF, BLOCK_N]
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in range(H_KV):
            col = j * HEAD_DIM
            in_group = (group == j)[:, None]
            k_lo = tl.zeros([BLOCK_HALF, BLOCK_N], tl.float32)
            k_hi = tl.zeros([BLOCK_HALF, BLOCK_N], tl.float32)
            k_pass = tl.zeros([BLOCK_PASS, BLOCK_N], tl.float32)
            for k0 in range(0, R_K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < R_K
                c_t = tl.load(ck_ptr + b * stride_kb + offs_n[None, :] * stride_kn
                              + offs_k[:, None] * stride_kr,
                              mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                k_lo = mma(_basis_cols_t(basis_ptr, offs_k, k_ok, col, HALF,
                                         stride_pr, stride_pf, BLOCK_HALF), c_t, k_lo,
                           UPCAST, PRECISION)
                k_hi = mma(_basis_cols_t(basis_ptr, offs_k, k_ok, col + HALF, HALF,
                                         stride_pr, stride_pf, BLOCK_HALF), c_t, k_hi,
                           UPCAST, PRECISION)
                if PASS > 0:
                    k_pass = mma(_basis_cols_t(basis_ptr, offs_k, k_ok, col + 2 * HALF, PASS,
                                               stride_pr, stride_pf, BLOCK_PASS), c_t, k_pass,
                                 UPCAST, PRECISION)
            r_lo = (k_lo * cos - k_hi * sin).to(q_lo.dtype)
            r_hi = (k_hi * cos + k_lo * sin).to(q_lo.dtype)
            s = mma(tl.where(in_group, q_lo, 0.0), r_lo, s, UPCAST, PRECISION)
            s = mma(tl.where(in_group, q_hi, 0.0), r_hi, s, UPCAST, PRECISION)
            if PASS > 0:
                s = mma(tl.where(in_group, q_pass, 0.0), k_pass.to(q_lo.dtype), s,
                        UPCAST, PRECISION)
        visible = visible_keys(offs_n, hi, b, tq, kv_end, mask_ptr, stride_mb, stride_mn,
                               T, HAS_MASK)
        v = tl.load(cv_ptr + b * stride_vb + offs_n[:, None] * stride_vn
                    + offs_v[None, :] * stride_vr,
                    mask=n_ok[:, None] & v_ok[None, :], other=0.0)
        m_i, l_i, acc = softmax_step(s * qk_scale, visible, m_i, l_i, acc, v, UPCAST, PRECISION)

    store_result(acc, m_i, l_i, b, split, vc, rows, head, tq, offs_v, row_ok, v_ok, H * T, R_V,
                 out_ptr, stride_ob, stride_oh, stride_ot, stride_or, m_ptr, l_ptr, acc_ptr,
                 SINGLE_SPLIT)


def reconstruct_decode_triton(q, c_k, c_v, basis, positions, inv_freq, scale: float,
                              mask=None, start=None, length=None,
                              num_splits: int | None = None) -> torch.Tensor:
    """Launch on validated inputs: ``q`` ``(B, H, T, d)``, ``c_k`` ``(B, N, r_k)``, ``c_v``
    ``(B, N, r_v)``, ``basis`` ``(r_k, h_kv*d)``, ``positions`` ``(B, N)``, ``inv_freq``
    ``(rotary_dim/2,)`` contiguous. Returns ``(B, H, T, r_v)`` in ``q.dtype``."""
    heads, head_dim = q.shape[1], q.shape[3]
    n, r_k, r_v = c_k.shape[1], c_k.shape[2], c_v.shape[2]
    half = inv_freq.shape[0]
    launch = DecodeLaunch.prepare(q, n, r_k, r_v, 64, num_splits)
    wrap_triton(_reconstruct_split_kernel)[launch.grid](
        q_ptr=q, ck_ptr=c_k, cv_ptr=c_v, basis_ptr=basis, pos_ptr=positions,
        inv_freq_ptr=inv_freq, **launch.kernel_args(), **range_args(mask, start, length, n),
        H=heads, H_KV=basis.shape[1] // head_dim, N=n, R_K=r_k, R_V=r_v,
        qk_scale=scale * LOG2E, **strides("q", "bhtr", q), **strides("k", "bnr", c_k),
        **strides("v", "bnr", c_v), **strides("p", "rf", basis),
        **strides("pos", "bn", positions), HEAD_DIM=head_dim, HALF=half,
        BLOCK_HALF=block_cols(half, 1 << 30),
        BLOCK_PASS=block_cols(max(1, head_dim - 2 * half), 1 << 30), num_warps=8)
    return launch.finish()
