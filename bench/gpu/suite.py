"""The GPU suite: prove and measure the kernels in one short call (issue #39; bench/gpu/README.md).

    python bench/gpu/suite.py OUT [--cpu-smoke] [--budget-s 480] [--steps env kernels decode e2e]

Steps, each a child process under its own time limit (its budget plus whatever earlier steps
left unused, never past the whole budget), its output appended to ``OUT/suite.log``:

- ``env``: machine, versions, the device-to-device copy bandwidth (``OUT/env.json``);
- ``kernels``: ``pytest`` of tests/kernels, tests/compile/test_latent_attention.py and
  bench/gpu/test_cuda_paths.py, on CUDA where there is a GPU (``OUT/kernels.xml``, JUnit);
- ``decode``: bench/decode_attention.py (``OUT/decode.json``, ``OUT/decode.md``);
- ``e2e``: bench/gpu/end_to_end.py (``OUT/e2e.json``, ``OUT/e2e.md``).

The benches rewrite their reports after every row, and ``OUT/summary.md`` is rewritten after
every step, so a run cut short still returns what it measured (at most these 8 files: what the
GPU machine sends back). ``--cpu-smoke`` runs the same steps on a CPU at toy sizes (the Triton
kernel under the interpreter, the benches' ``--smoke``), in about a minute: CI runs it
(tests/test_gpu_suite.py) so that the GPU call finds no typo. Exits non-zero where a step
failed or ran out of time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG_LIMIT = 15 << 20  # bytes of suite.log (the GPU machine returns files of up to 16 MiB)


@dataclass
class Step:
    name: str
    budget_s: float  # on a GPU; the smoke's whole run is bounded by its own budget
    argv: list[str]
    env: dict = field(default_factory=dict)


def steps(out: Path, smoke: bool) -> list[Step]:
    py = sys.executable
    tests = (["tests/kernels/test_kernels.py", "-k", "float32 or long_context"] if smoke
             else ["tests/kernels", "tests/compile/test_latent_attention.py"])
    bench = ["--smoke"] if smoke else []
    # the first run (bench/results/gpu_suite-h100.md) spent 142 s on 12 shapes and left the
    # end-to-end step too little time: the goal shapes and batch 1 only
    shapes = [] if smoke else ["--contexts", "8192", "32768", "--batches", "1", "8", "16"]
    e2e = ["--models", "llama3-8b", "--contexts", "64"] if smoke else []
    return [
        Step("env", 30, [py, __file__, "--env", str(out / "env.json")]),
        Step("kernels", 170, [py, "-m", "pytest", *tests, "bench/gpu/test_cuda_paths.py", "-q",
                              "-p", "no:cacheprovider", "--junitxml", str(out / "kernels.xml")],
             {"LORC_GPU_SMOKE": "1"} if smoke else {}),
        Step("decode", 100, [py, "bench/decode_attention.py", "--out", str(out / "decode"),
                             *bench, *shapes]),
        Step("e2e", 180, [py, "bench/gpu/end_to_end.py", "--out", str(out / "e2e"), *bench, *e2e]),
    ]


# ------------------------------------------------------------------------------- the env step

def copy_gb_per_s() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    import triton.testing

    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=100, return_mode="median")
    return 2 * x.nbytes / ms / 1e6


def environment(path: Path) -> None:
    """Versions, the device and its copy bandwidth, the commit (``$LORC_COMMIT``, else git's
    where .git travelled)."""
    import torch

    info = dict(python=platform.python_version(), torch=torch.__version__,
                cuda=torch.version.cuda, gpu=torch.cuda.get_device_name()
                if torch.cuda.is_available() else None, cpus=os.cpu_count())
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    import lorc_fx

    info["lorc_fx"] = str(Path(lorc_fx.__file__).parent)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True)
    info["commit"] = os.environ.get("LORC_COMMIT") or commit.stdout.strip() or None
    if info["gpu"]:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                             text=True, capture_output=True)
        info["nvidia_smi"] = smi.stdout.strip()
        info["copy_gb_per_s"] = copy_gb_per_s()
    path.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


# ------------------------------------------------------------------------------- running

def run_step(step: Step, limit_s: float, log) -> dict:
    """``step`` in its own process group, killed with its children past ``limit_s``; its
    output echoed and appended to the log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log(f"\n===== {step.name} (limit {limit_s:.0f} s): {' '.join(step.argv)}\n")
    start = time.perf_counter()
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    reader = threading.Thread(target=lambda: [log(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(limit_s, 1))
        status = "passed" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = f"timed out after {limit_s:.0f} s"
    reader.join(timeout=10)
    wall = time.perf_counter() - start
    log(f"===== {step.name}: {status} in {wall:.0f} s\n")
    return dict(status=status, wall_s=wall, limit_s=limit_s)


def junit_counts(path: Path) -> dict | None:
    """Tests, failures, errors, skipped and the failed tests' ids from a JUnit file."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{case.get('classname')}::{case.get('name')}"
                        for case in suite.iter("testcase")
                        if case.find("failure") is not None or case.find("error") is not None]
    return counts


def summary(out: Path, results: dict, smoke: bool, budget_s: float) -> str:
    lines = ["# GPU suite" + (" (CPU smoke run)" if smoke else ""), ""]
    env = out / "env.json"
    if env.is_file():
        e = json.loads(env.read_text())
        lines.append(f"Machine: {e.get('gpu') or 'no GPU'} ({e.get('nvidia_smi') or 'CPU'}); "
                     f"{e['cpus']} CPUs; python {e['python']}, torch {e['torch']} (CUDA "
                     f"{e['cuda']}), triton {e['triton']}, transformers {e['transformers']}; "
                     f"commit {e['commit'] or 'unknown'}."
                     + (f" Copy bandwidth {e['copy_gb_per_s']:.0f} GB/s (read + written)."
                        if e.get("copy_gb_per_s") else ""))
        lines.append("")
    lines += [f"Budget {budget_s:.0f} s.", "", "| step | status | seconds | limit |",
              "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['status']} | {r['wall_s']:.0f} | {r['limit_s']:.0f} |")
    counts = junit_counts(out / "kernels.xml")
    if counts:
        lines += ["", "## Kernel tests", "",
                  f"{counts['tests']} tests: {counts['failures']} failed, {counts['errors']} "
                  f"errors, {counts['skipped']} skipped (JUnit: kernels.xml)."]
        lines += [f"- FAILED {name}" for name in counts["failed"]]
    for stem in ("decode", "e2e"):
        md = out / f"{stem}.md"
        if md.is_file():  # its headings one level down
            lines += [""] + ["#" + l if l.startswith("#") else l
                             for l in md.read_text().splitlines()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="results folder")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same steps on a CPU at toy sizes (CI)")
    parser.add_argument("--budget-s", type=float, help="the whole run (default: 480 on a "
                        "GPU, 240 for the smoke)")
    parser.add_argument("--steps", nargs="+", choices=["env", "kernels", "decode", "e2e"])
    parser.add_argument("--env", type=Path, help=argparse.SUPPRESS)  # the env step itself
    args = parser.parse_args(argv)
    if args.env:
        environment(args.env)
        return 0
    if args.out is None:
        parser.error("give the results folder")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (240.0 if args.cpu_smoke else 480.0)
    scratch = Path(tempfile.mkdtemp(prefix="lorc-gpu-suite-"))
    # calibration and sampled text of the e2e step's plans, apart from the user's cache
    os.environ.setdefault("LORC_CACHE_DIR", str(scratch / "lorc-cache"))
    if args.cpu_smoke:
        os.environ["OMP_NUM_THREADS"] = "1"
    log_path, written = out / "suite.log", 0
    log_path.write_text("")
    lock = threading.Lock()

    def log(text: str) -> None:
        nonlocal written
        sys.stdout.write(text)
        sys.stdout.flush()
        with lock:
            if written < LOG_LIMIT:
                with log_path.open("a") as f:
                    f.write(text[:LOG_LIMIT - written])
                written += len(text)

    start, results, spare = time.perf_counter(), {}, 0.0
    for step in steps(out, args.cpu_smoke):
        if args.steps and step.name not in args.steps:
            continue
        left = budget - (time.perf_counter() - start)
        if left < 5:
            results[step.name] = dict(status="not run: budget spent", wall_s=0, limit_s=0)
            continue
        limit = left if args.cpu_smoke else min(step.budget_s + spare, left)
        results[step.name] = run_step(step, limit, log)
        spare = max(0.0, limit - results[step.name]["wall_s"]) if not args.cpu_smoke else 0.0
        (out / "summary.md").write_text(summary(out, results, args.cpu_smoke, budget))
    shutil.rmtree(scratch, ignore_errors=True)
    log(f"\nsuite: {time.perf_counter() - start:.0f} s; summary in {out / 'summary.md'}\n")
    return 0 if all(r["status"] == "passed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
