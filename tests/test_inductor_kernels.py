"""The tests' Inductor settings (tests/conftest.py): scalar C++ kernels, except in tests
marked ``vectorized``, which get the SIMD kernels users' machines get."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code


def _generated_code() -> str:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x.sin() * 2).sum(-1))
    _, code = run_and_get_code(compiled, torch.randn(64, 256))
    torch._dynamo.reset()
    return "\n".join(code)


def test_other_tests_compile_scalar_kernels():
    assert "at::vec" not in _generated_code()


@pytest.mark.vectorized
def test_vectorized_tests_compile_simd_kernels():
    assert "at::vec" in _generated_code()
