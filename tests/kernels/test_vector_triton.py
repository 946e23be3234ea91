"""The Triton kernels of ``lorc::vector_scores`` / ``vector_sums`` (``kernels.vector_triton``)
against float64 maths over the codes decoded.

On a GPU (the GPU suite, bench/gpu) they run on CUDA tensors in this process; elsewhere on CPU
tensors under the Triton interpreter, in one child process (``helpers.interpreted``), and each
test checks its case's result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `helpers`, run as a script too
from helpers.interpreted import case_results, each_case  # noqa: E402
from helpers.vector_codes import side  # noqa: E402

from lorc_fx.codes.vector import BLOCK  # noqa: E402
from lorc_fx.kernels import triton_available, vector_reductions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and triton_available() else "cpu"

# (runs (sub-vectors, channels, index bits), batch, blocks, query rows): every index width
# 1-8 bits (whole bytes and words a block), 1 to 40 query rows (one and four row vectors),
# one tile of slots, several, and more than one split of the sums (SPLIT_SLOTS)
CASES = {
    "whole-bytes": ([(3, 4, 1), (2, 1, 2), (1, 16, 4), (2, 8, 8)], 2, 5, 9),
    "words": ([(2, 2, 3), (1, 4, 5), (3, 1, 6), (1, 8, 7)], 1, 9, 1),
    "many-rows": ([(4, 4, 6), (2, 16, 8)], 2, 3, 40),
    "splits": ([(2, 2, 2), (3, 8, 3), (1, 1, 4), (2, 2, 6), (1, 4, 7)], 1, 140, 3),
    "default-model-like": ([(16, 1, 6), (16, 1, 5), (8, 2, 6), (4, 4, 8), (4, 8, 8)], 1, 24, 9),
}


def run_case(name: str) -> dict:
    """The worst ratio of each reduction's error to its float32 rounding bound."""
    layout, batch, blocks, rows = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    payload, tables, latent = side(gen, batch, blocks, layout)
    q = torch.randn(batch, rows, latent.shape[-1], generator=gen)
    # the weights as attention hands them: the codes' slots of a longer row (window after)
    p = torch.rand(batch, rows, blocks * BLOCK + 7, generator=gen)[..., :blocks * BLOCK]
    on = lambda xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    from lorc_fx.kernels import vector_triton

    got = {"scores": vector_triton.scores(q.to(DEVICE), on(payload), on(tables)),
           "sums": vector_triton.sums(p.to(DEVICE), on(payload), on(tables))}
    exact = {"scores": (q.double(), latent.transpose(1, 2), latent.shape[-1]),
             "sums": (p.double(), latent, blocks * BLOCK + 256)}
    out = {}
    for what, (weights, values, terms) in exact.items():
        bound = (terms + 4) * 2.0 ** -24 * (weights.abs() @ values.abs()) + 1e-30
        error = (got[what].cpu().double() - weights @ values).abs()
        out[what] = dict(shape=list(got[what].shape), want=list((weights @ values).shape),
                         dtype=str(got[what].dtype), worst=float((error / bound).max()))
    return out


@pytest.fixture(scope="module")
def results(request):
    """Each selected case's summary (``helpers.interpreted``)."""
    return case_results(request, "test_kernels_match_float64", __file__, run_case,
                        on_gpu=DEVICE == "cuda")


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_float64(results, name):
    result = results[name]
    assert "error" not in result, result.get("error")
    for what in ("scores", "sums"):
        assert result[what]["shape"] == result[what]["want"], what
        assert result[what]["dtype"] == "torch.float32", what
        assert result[what]["worst"] <= 1, what


def test_the_kernels_pack_blocks_as_the_codes_do():
    pytest.importorskip("triton")
    from lorc_fx.kernels import vector_triton

    assert vector_triton.BLOCK == BLOCK


def test_cuda_tensors_run_the_triton_kernels():
    """The ops' CUDA implementation is the Triton one where Triton is installed (then
    ``native_applies`` says a kernel serves CUDA tensors); without it, none."""
    registered = {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"lorc::{op}", "CUDA")
                  for op in ("vector_scores", "vector_sums")}
    assert registered == {"vector_scores": triton_available(), "vector_sums": triton_available()}
    assert vector_reductions.native_applies(torch.device("cuda")) == triton_available()


if __name__ == "__main__":  # the child process: the named cases' results as one JSON line
    print(json.dumps(each_case(run_case, sys.argv[1:])))
