"""The nearest-codeword kernel against float64 distances, and its tensor-maths fallback."""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorc_fx.codes.vector import VectorSpec, decode, encode, fit, reconstruction
from lorc_fx.kernels import nearest_codeword as kernel

X86_AVX2 = (platform.machine().lower() in ("x86_64", "amd64") and Path("/proc/cpuinfo").exists()
            and " avx2" in Path("/proc/cpuinfo").read_text())
native = pytest.mark.skipif(not X86_AVX2, reason="the kernel is built for x86-64 with AVX2")


def assert_nearest(idx, x, codewords):
    """Each pick within float32 rounding of the least float64 distance (``||c||² - 2x·c``
    rounds at ~1e-6 of ``||c||² + 2|x||c|``: a tie may go either way, a wrong pick is farther)."""
    assert idx.shape == x.shape[:2] and idx.dtype == torch.int64
    dist = ((x.double()[:, :, None] - codewords.double()[:, None]) ** 2).sum(-1)  # (S, n, K)
    picked = dist.gather(-1, idx[..., None])[..., 0]
    scale = (codewords.double() ** 2).sum(-1).amax() + 2 * x.double().norm(dim=-1, keepdim=True
                                                                          ).amax() * 10
    assert ((picked - dist.amin(-1)) <= 1e-5 * scale).all()


@native
def test_the_kernel_builds_here():
    x = torch.randn(2, 5, 4)
    assert kernel._library() is not None and kernel.native_applies(x, x[:, :4])
    assert not kernel.native_applies(torch.randn(2, 5, 3), torch.randn(2, 4, 3))


@native
@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from(kernel.KERNEL_DIMS), count=st.sampled_from([1, 2, 3, 16, 64, 256]),
       sets=st.integers(1, 5), n=st.integers(1, 70), seed=st.integers(0, 99))
def test_the_kernel_picks_the_nearest_codeword(d, count, sets, n, seed):
    """Any number of samples (whole vectors and a partial last one), any table size, each
    set against its own table."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sets, n, d, generator=gen) * 2
    codewords = torch.randn(sets, count, d, generator=gen) * 2
    assert_nearest(kernel.nearest_codeword(x, codewords), x, codewords)


@native
def test_the_kernel_keeps_the_first_of_equal_codewords():
    codewords = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]]).repeat(1, 8, 1)
    x = torch.tensor([[[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]]])
    assert kernel.nearest_codeword(x, codewords).tolist() == [[0, 1, 0]]


def test_without_the_kernel_the_same_picks(monkeypatch):
    """Where the kernel does not serve (another device, a sub-vector of 3 channels, no
    compiler) tensor maths picks the same codewords."""
    gen = torch.Generator().manual_seed(3)
    x, codewords = torch.randn(3, 50, 4, generator=gen), torch.randn(3, 32, 4, generator=gen)
    monkeypatch.setattr(kernel, "_library", lambda: None)
    assert_nearest(kernel.nearest_codeword(x, codewords), x, codewords)
    odd = torch.randn(2, 20, 3, generator=gen)
    assert_nearest(kernel.nearest_codeword(odd, odd[:, :5] + 0.1), odd, odd[:, :5] + 0.1)
    with pytest.raises(ValueError, match=r"take codewords of \(3, K, 4\)"):
        kernel.nearest_codeword(x, codewords[:, :, :2])


def test_books_fitted_with_the_kernel_code_as_the_codes_decode():
    """A book fitted with the kernel as k-means' assignment step, and the reconstruction the
    planner measures its error on, are the codes' own ``decode(encode(...))``."""
    gen = torch.Generator().manual_seed(4)
    samples = torch.randn(900, 32, generator=gen) * torch.linspace(3, 0.1, 32)
    for bits in (1, 2.5, 4):
        book = fit(samples, VectorSpec(((32, bits),), 16), iters=5,
                   assign=kernel.nearest_codeword)
        coded = decode(encode(samples[None], book), book)[0]
        rebuilt = reconstruction(samples, book, kernel.nearest_codeword)
        # a sample halfway between two codewords may go either way: nearly all agree exactly
        assert (rebuilt == coded).all(-1).float().mean() > 0.99
