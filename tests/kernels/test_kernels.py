"""The decode attention kernel against the float64 reference.

Where a GPU is present (the GPU suite, bench/gpu) the Triton kernel runs on CUDA tensors, in
this process; elsewhere on CPU tensors under the Triton interpreter, in one child process (this
file run as a script, ~10 s; ``helpers.interpreted``), and each test checks its case's result.
The op's torch fallback and its registration are checked in-process.
"""
from __future__ import annotations

import json
import math
import sys
from itertools import product
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `helpers`, run as a script too
from helpers.interpreted import case_results, each_case  # noqa: E402

from lorc_fx.kernels import latent_decode_reference, ops, triton_available  # noqa: E402

# relative Frobenius error bound per input dtype (kernel math is float32; p is rounded to the
# input dtype before its tensor-core product, as on a GPU)
RTOL = {torch.float32: 2e-6, torch.float16: 1.5e-3, torch.bfloat16: 1.5e-2}
DTYPES = list(RTOL)
DEVICE = "cuda" if torch.cuda.is_available() and triton_available() else "cpu"


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
    (2, 32, 1, 129, 37, 45, "mask", None),  # odd ranks; the split count from the SM count
]


def latent_case(case, dtype):
    """``(out, ref)`` of the Triton kernel and the float64 reference."""
    from lorc_fx.kernels.latent_decode import latent_decode_triton

    batch, heads, t, n, r_k, r_v, kind, splits = case
    gen = torch.Generator().manual_seed(n * 1000 + r_k)
    q = queries(batch, heads, t, r_k, dtype, gen)
    c_k, c_v = cache_latent(batch, n, r_k, dtype, gen), cache_latent(batch, n, r_v, dtype, gen)
    mask, start, length = visibility_args(kind, batch, n, gen)
    args = [x if x is None else x.to(DEVICE) for x in (q, c_k, c_v, mask, start, length)]
    args.insert(3, 1 / math.sqrt(r_k))
    return latent_decode_triton(*args, splits), latent_decode_reference(*args)


KERNEL_CASES = {f"latent-{case}-{dtype}": (latent_case, case, dtype)
                for case, dtype in product(LATENT_CASES, DTYPES)}


def summarize(out: torch.Tensor, ref: torch.Tensor) -> dict:
    empty = ref.abs().amax(dim=(1, 2, 3)) == 0  # batch rows with no visible key
    return dict(same_shape=out.shape == ref.shape, dtype=str(out.dtype), rel_err=rel_err(out, ref),
                empty_rows=int(empty.sum()), empty_rows_zero=bool((out[empty] == 0).all()))


def run_kernel_case(name: str) -> dict:
    run, case, dtype = KERNEL_CASES[name]
    return summarize(*run(case, dtype))


@pytest.fixture(scope="module")
def kernel_results(request):
    """Summaries of the kernel cases this session selected (``helpers.interpreted``)."""
    return case_results(request, "test_kernel_matches_reference", __file__, run_kernel_case,
                        on_gpu=DEVICE == "cuda")


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(kernel_results, name):
    dtype = KERNEL_CASES[name][2]
    result = kernel_results[name]
    assert "error" not in result, result.get("error")
    assert result["same_shape"] and result["dtype"] == str(dtype)
    assert result["rel_err"] < RTOL[dtype]
    assert result["empty_rows_zero"]


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


def test_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(2)
    q, c_k = torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 7, 12, generator=gen)
    c_v = torch.randn(2, 7, 6, generator=gen)
    start = torch.tensor([0, 3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lorc.latent_decode.default,
                          (q, c_k[..., :8], c_v, 0.5), dict(start=start))


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_cuda_path_traces_into_triton_kernels():
    """Under AOTAutograd (what Inductor sees) the op decomposes into its Triton kernels.

    Uses fake CUDA tensors; without a GPU Triton cannot analyse which arguments a kernel mutates
    and torch logs a warning (assumes all), which is expected here.
    """
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import (
        kernel_side_table, triton_kernel_wrapper_functional)
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Decode(torch.nn.Module):
        def forward(self, q_latent, c_k, c_v):
            return (torch.ops.lorc.latent_decode(q_latent, c_k, c_v, 0.5, num_splits=4),)

    with FakeTensorMode():
        cuda = dict(device="cuda", dtype=torch.bfloat16)
        inputs = (torch.empty(2, 8, 12, **cuda), torch.empty(2, 1000, 12, **cuda),
                  torch.empty(2, 1000, 20, **cuda))
    graph, _ = aot_export_module(Decode(), inputs, trace_joint=False)
    launched = [kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                for node in graph.graph.nodes if node.target is triton_kernel_wrapper_functional]
    assert launched == ["_latent_split_kernel", "_combine_splits_kernel"]
    assert "lorc" not in graph.code


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("scale_type", ["fp32", "fp64"])
def test_the_kernel_builds_for_a_gpu_whatever_type_the_scale_is_passed_as(scale_type):
    """Inductor passes a Python float to a user Triton kernel as fp64 on GPUs that have fp64
    (``torch._inductor.codegen.triton_utils.signature_of``), the eager launch as fp32: the
    kernel's IR must build for an sm_90 target either way (the fp64 scale once turned the
    softmax state fp64 and broke compiled ``generate`` on an H100). Builds the IR only: no GPU."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton._C.libtriton import ir

    from lorc_fx.kernels.latent_decode import _latent_split_kernel as kernel

    constexprs = dict(T=1, HAS_MASK=False, HAS_RANGE=False, SINGLE_SPLIT=False, UPCAST=False,
                      PRECISION="ieee", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, BLOCK_V=64)
    pointers = {**dict.fromkeys(("m_ptr", "l_ptr", "acc_ptr"), "*fp32"),
                **dict.fromkeys(("mask_ptr", "start_ptr", "length_ptr"), "*i32")}

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name == "qk_scale":
            return scale_type
        if name.endswith("_ptr"):
            return pointers.get(name, "*bf16")  # q, the latents, the output
        return "i32"

    signature = {name: arg_type(name) for name in inspect.signature(kernel.fn).parameters}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(kernel, signature, constexprs).make_ir(
        target, options, backend.get_codegen_implementation(options),
        backend.get_module_map(), context)
    assert "tt.dot" in str(module)


if __name__ == "__main__":
    print(json.dumps(each_case(run_kernel_case, sys.argv[1:])))
