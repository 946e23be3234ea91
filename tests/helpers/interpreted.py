"""Triton kernel cases run where they can be: on CUDA tensors in this process where a GPU is
present (the GPU suite), else on CPU tensors under the Triton interpreter in a child process.
Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, its own standard
library included, so the variable must be set before Triton is first imported; within a
pytest session that is out of a test module's hands. The child runs the test module as a
script (its ``__main__`` prints the cases' results as one JSON line)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Callable

import pytest


def each_case(run: Callable[[str], dict], names) -> dict:
    """Each named case's result, or its traceback (the test that asked shows it)."""
    results = {}
    for name in names:
        try:
            results[name] = run(name)
        except Exception:
            results[name] = dict(error=traceback.format_exc())
    return results


def case_results(request, test: str, script: str, run: Callable[[str], dict],
                 on_gpu: bool) -> dict:
    """The results of the cases of parametrized test ``test`` (its ``name`` parameter) this
    session selected: ``run`` here where ``on_gpu``, else in ``script`` under the
    interpreter."""
    pytest.importorskip("triton")
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == test]
    if on_gpu:
        return each_case(run, names)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, script, *names], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])
