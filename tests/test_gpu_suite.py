"""The GPU suite (bench/gpu/suite.py) runs through on a CPU at toy sizes (``--cpu-smoke``), so
the one short call a lent GPU gets finds no typo in it. ~60 s on one core."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_suite_runs_through_on_a_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/suite.py"), str(tmp_path),
                           "--cpu-smoke"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TORCHINDUCTOR_VEC_ISA_OK="0"))  # conftest.py
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for step in ("env", "kernels", "decode", "e2e"):
        assert f"| {step} | passed |" in summary
    assert "0 failed, 0 errors, 0 skipped" in summary
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert decode["complete"] and decode["rows"]
    assert all(set(row) >= {"sdpa", "int8", "int4", "latent4", "latent16", "vector"}
               for row in decode["rows"])
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    runs = [run for runs in e2e["models"].values() for run in runs]
    assert e2e["complete"] and {r["scheme"] for r in runs} == {"full", "int8", "latent4"}
    assert not [r["error"] for r in runs if "error" in r]
    assert all(r["same_batch"]["graphs_compiled"] > 0 for r in runs)
    assert any(r.get("max_batch", {}).get("fits") for r in runs)
    assert len(list(tmp_path.iterdir())) <= 8  # what the GPU machine sends back
