"""Decode attention kernels against the float64 reference.

The Triton kernels run on CPU tensors under the Triton interpreter. Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, its own standard library included,
so the variable must be set before Triton is first imported; within a pytest session that is out
of this module's hands. The kernel cases therefore run in one child process (this file run as a
script, ~15 s) and each test checks its case's result. The ops' torch fallback and their
registration are checked in-process.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import traceback
from itertools import product
from pathlib import Path

import pytest
import torch

from lorc_fx.kernels import (
    latent_decode_reference, ops, reconstruct_decode_reference, triton_available)

# relative Frobenius error bound per input dtype (kernel math is float32; p and rebuilt keys are
# rounded to the input dtype before their tensor-core products, as on a GPU)
RTOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1.5e-2}
DTYPES = list(RTOL)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def cache_latent(batch: int, n: int, width: int, dtype, gen) -> torch.Tensor:
    """A ``(B, N, width)`` view into a padded ``(B, 1, N + 5, width + 8)`` cache buffer."""
    buf = torch.randn(batch, 1, n + 5, width + 8, generator=gen).to(dtype)
    return buf[:, 0, 2:n + 2, 3:width + 3]


def queries(batch: int, heads: int, t: int, width: int, dtype, gen) -> torch.Tensor:
    """``(B, H, T, width)`` with a non-contiguous layout (stored as ``(B, T, H, width)``)."""
    return torch.randn(batch, t, heads, width, generator=gen).to(dtype).transpose(1, 2)


def visibility_args(kind: str, batch: int, n: int, gen):
    """``(mask, start, length)`` for: none, left padding as a mask, or start/length ranges (one
    row empty past the first split, one row with no visible key at all)."""
    if kind == "none":
        return None, None, None
    starts = torch.randint(0, n // 2, (batch,), generator=gen, dtype=torch.int32)
    if kind == "mask":
        mask = torch.arange(n)[None] >= starts[:, None]
        mask[:, -1] = True
        return mask & (torch.rand(batch, n, generator=gen) > 0.1), None, None
    starts[0] = n - 7  # the leading splits of this row see no key
    length = n - starts
    if batch > 2:
        length[2] = 0  # no visible key: zeros
    return None, starts, length


LATENT_CASES = [  # B, H, T, N, r_k, r_v, visibility, num_splits
    (1, 8, 1, 33, 16, 16, "none", 1),
    (2, 32, 1, 150, 40, 24, "mask", 3),
    (3, 12, 1, 200, 96, 72, "range", 4),
    (2, 4, 3, 90, 20, 36, "range", 2),
    (1, 40, 1, 80, 24, 300, "mask", 2),  # BLOCK_M 64: r_v split over two programs
]


def latent_case(case, dtype):
    """``(out, ref)`` of the Triton kernel and the float64 reference."""
    from lorc_fx.kernels.latent_decode import latent_decode_triton

    batch, heads, t, n, r_k, r_v, kind, splits = case
    gen = torch.Generator().manual_seed(n * 1000 + r_k)
    q = queries(batch, heads, t, r_k, dtype, gen)
    c_k, c_v = cache_latent(batch, n, r_k, dtype, gen), cache_latent(batch, n, r_v, dtype, gen)
    mask, start, length = visibility_args(kind, batch, n, gen)
    args = (q, c_k, c_v, 1 / math.sqrt(r_k), mask, start, length)
    return latent_decode_triton(*args, splits), latent_decode_reference(*args)


RECONSTRUCT_CASES = [  # B, H, h_kv, T, N, r_k, r_v, d, rotary_dim, visibility, num_splits
    (2, 8, 2, 1, 100, 24, 40, 16, 16, "mask", 2),  # GQA, full rotary
    (1, 4, 1, 1, 70, 20, 20, 32, 8, "none", 1),  # MQA, partial rotary
    (3, 4, 4, 2, 90, 48, 16, 16, 12, "range", 2),  # MHA, partial rotary, T = 2
]


def rope_inputs(batch: int, n: int, rotary_dim: int, start):
    """Positions counted from each row's first visible token (as with left padding)."""
    first = torch.zeros(batch, dtype=torch.long) if start is None else start.long()
    positions = (torch.arange(n)[None] - first[:, None]).clamp(min=0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    return positions, inv_freq


def reconstruct_case(case, dtype):
    from lorc_fx.kernels.reconstruct_decode import reconstruct_decode_triton

    batch, heads, kv_heads, t, n, r_k, r_v, d, rotary_dim, kind, splits = case
    gen = torch.Generator().manual_seed(n * 1000 + r_k)
    q = queries(batch, heads, t, d, dtype, gen)
    c_k, c_v = cache_latent(batch, n, r_k, dtype, gen), cache_latent(batch, n, r_v, dtype, gen)
    basis = torch.linalg.qr(torch.randn(kv_heads * d, r_k, generator=gen))[0].T.to(dtype)
    mask, start, length = visibility_args(kind, batch, n, gen)
    positions, inv_freq = rope_inputs(batch, n, rotary_dim, start)
    args = (q, c_k, c_v, basis, positions, inv_freq, 1 / math.sqrt(d), mask, start, length)
    return reconstruct_decode_triton(*args, splits), reconstruct_decode_reference(*args)


KERNEL_CASES = {
    **{f"latent-{case}-{dtype}": (latent_case, case, dtype)
       for case, dtype in product(LATENT_CASES, DTYPES)},
    **{f"reconstruct-{case}-{dtype}": (reconstruct_case, case, dtype)
       for case, dtype in product(RECONSTRUCT_CASES, DTYPES)},
}


def summarize(out: torch.Tensor, ref: torch.Tensor) -> dict:
    empty = ref.abs().amax(dim=(1, 2, 3)) == 0  # batch rows with no visible key
    return dict(same_shape=out.shape == ref.shape, dtype=str(out.dtype), rel_err=rel_err(out, ref),
                empty_rows=int(empty.sum()), empty_rows_zero=bool((out[empty] == 0).all()))


def run_kernel_cases() -> dict:
    """Child process entry: every kernel case's summary, or its traceback."""
    results = {}
    for name, (run, case, dtype) in KERNEL_CASES.items():
        try:
            results[name] = summarize(*run(case, dtype))
        except Exception:  # report per case; the parent test shows it
            results[name] = dict(error=traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def interpreted():
    """Kernel case summaries from a child process running under ``TRITON_INTERPRET=1``."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(interpreted, name):
    dtype = KERNEL_CASES[name][2]
    result = interpreted[name]
    assert "error" not in result, result.get("error")
    assert result["same_shape"] and result["dtype"] == str(dtype)
    assert result["rel_err"] < RTOL[dtype]
    assert result["empty_rows_zero"]


def test_reconstruct_reference_equals_rebuilt_attention():
    """The reconstruct reference is attention over ``rope(P^T c)`` keys and ``P_v^T c_v`` values."""
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, n, d, r = 2, 4, 2, 12, 8, 16
    p_k = torch.linalg.qr(torch.randn(kv_heads * d, r, generator=gen, dtype=torch.float64))[0].T
    p_v = torch.linalg.qr(torch.randn(kv_heads * d, r, generator=gen, dtype=torch.float64))[0].T
    c_k = torch.randn(batch, n, r, generator=gen, dtype=torch.float64)
    c_v = torch.randn(batch, n, r, generator=gen, dtype=torch.float64)
    q = torch.randn(batch, heads, 1, d, generator=gen, dtype=torch.float64)
    positions, inv_freq = rope_inputs(batch, n, d, None)
    latent = reconstruct_decode_reference(q, c_k, c_v, p_k, positions, inv_freq, 0.3)
    out = torch.einsum("bhtr,rhd->bhtd", latent,
                       p_v.view(r, kv_heads, d).repeat_interleave(heads // kv_heads, 1))

    keys = (c_k @ p_k).view(batch, n, kv_heads, d)
    angle = (positions.float()[..., None] * inv_freq).double()[:, :, None, :]
    lo, hi = keys[..., :d // 2], keys[..., d // 2:]
    k = torch.cat([lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()], -1)
    v = (c_v @ p_v).view(batch, n, kv_heads, d)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_fall_back_to_torch_on_cpu(dtype):
    gen = torch.Generator().manual_seed(1)
    batch, heads, n, r_k, r_v = 2, 6, 40, 20, 12
    q = torch.randn(batch, heads, r_k, generator=gen).to(dtype)
    c_k = torch.randn(batch, 1, n, r_k, generator=gen).to(dtype)  # the cache's layout
    c_v = torch.randn(batch, 1, n, r_v, generator=gen).to(dtype)
    mask = torch.arange(n)[None] >= torch.tensor([[0], [9]])
    out = torch.ops.lorc.latent_decode(q, c_k, c_v, 0.25, mask)
    ref = latent_decode_reference(q[:, :, None], c_k[:, 0], c_v[:, 0], 0.25, mask)[:, :, 0]
    assert out.shape == (batch, heads, r_v) and out.dtype == dtype
    assert rel_err(out, ref) < RTOL[dtype]


def test_ops_reject_bad_inputs():
    q, c = torch.randn(1, 2, 8), torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match="share one of"):
        ops.latent_decode(q, c.half(), c, 1.0)
    with pytest.raises(ValueError, match="mask"):
        ops.latent_decode(q, c, c, 1.0, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="basis"):
        ops.reconstruct_decode(q, c, c, torch.randn(8, 12), torch.zeros(1, 5, dtype=torch.long),
                               torch.ones(4), 1.0)


def test_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(2)
    q, c_k = torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 7, 12, generator=gen)
    c_v = torch.randn(2, 7, 6, generator=gen)
    start = torch.tensor([0, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lorc.latent_decode.default,
                          (q, c_k[..., :8], c_v, 0.5), dict(start=start))
    positions, inv_freq = rope_inputs(2, 7, 6, start)
    basis = torch.randn(12, 16, generator=gen)
    torch.library.opcheck(torch.ops.lorc.reconstruct_decode.default,
                          (q, c_k, c_v, basis, positions, inv_freq, 0.5))


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_cuda_path_traces_into_triton_kernels():
    """Under AOTAutograd (what Inductor sees) the ops decompose into their Triton kernels.

    Uses fake CUDA tensors; without a GPU Triton cannot analyse which arguments a kernel mutates
    and torch logs a warning (assumes all), which is expected here.
    """
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import (
        kernel_side_table, triton_kernel_wrapper_functional)
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Decode(torch.nn.Module):
        def forward(self, q_latent, q, c_k, c_v, basis, positions, inv_freq):
            return (torch.ops.lorc.latent_decode(q_latent, c_k, c_v, 0.5, num_splits=4),
                    torch.ops.lorc.reconstruct_decode(q, c_k, c_v, basis, positions, inv_freq, 0.5,
                                                      num_splits=1))

    with FakeTensorMode():
        cuda = dict(device="cuda", dtype=torch.bfloat16)
        inputs = (torch.empty(2, 8, 12, **cuda), torch.empty(2, 8, 16, **cuda),
                  torch.empty(2, 1000, 12, **cuda),
                  torch.empty(2, 1000, 20, **cuda), torch.empty(12, 32, **cuda),
                  torch.empty(2, 1000, dtype=torch.long, device="cuda"),
                  torch.empty(8, device="cuda"))
    graph, _ = aot_export_module(Decode(), inputs, trace_joint=False)
    launched = [kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                for node in graph.graph.nodes if node.target is triton_kernel_wrapper_functional]
    assert launched == ["_latent_split_kernel", "_combine_splits_kernel",
                        "_reconstruct_split_kernel"]
    assert "lorc" not in graph.code


if __name__ == "__main__":
    print(json.dumps(run_kernel_cases()))
