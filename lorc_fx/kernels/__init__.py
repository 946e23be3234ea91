"""Decode attention over the low-rank KV latent: Triton kernels and torch ops.

Importing this package registers ``torch.ops.lorc.latent_decode`` and
``torch.ops.lorc.reconstruct_decode`` (Python callables: :mod:`lorc_fx.kernels.ops`); it does not
need Triton. The op callables are not re-exported here because the kernel submodules
``latent_decode`` and ``reconstruct_decode`` own those names.
"""
from .ops import triton_available
from .reference import latent_decode_reference, reconstruct_decode_reference

__all__ = ["triton_available", "latent_decode_reference", "reconstruct_decode_reference"]
