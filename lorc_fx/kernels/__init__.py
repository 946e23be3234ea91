"""Decode attention kernels and their torch ops.

Importing this package registers ``torch.ops.lorc.latent_decode`` (a Triton kernel over the
low-rank latent on CUDA: :mod:`lorc_fx.kernels.ops`; it does not need Triton) and
``torch.ops.lorc.nearest_codeword`` (product codes' nearest codewords, a C++ kernel on x86-64
CPUs: :mod:`lorc_fx.kernels.nearest_codeword`) and ``torch.ops.lorc.vector_scores`` /
``vector_sums`` (decode attention over product codes by table, a C++ kernel on x86-64 CPUs:
:mod:`lorc_fx.kernels.vector_reductions`); ``torch.ops.lorc.code_scores``, ``code_sums`` and
``code_attention`` (decode attention over quantized codes, ATen ops in C++ for x86-64 CPUs:
:mod:`lorc_fx.kernels.code_reductions`) exist once ``code_reductions.native_applies`` has
built them. The op callable is not re-exported here because the kernel submodule
``latent_decode`` owns that name.
"""
from . import code_reductions, nearest_codeword, vector_reductions
from .ops import triton_available
from .reference import latent_decode_reference

__all__ = ["code_reductions", "nearest_codeword", "vector_reductions", "triton_available", "latent_decode_reference"]
