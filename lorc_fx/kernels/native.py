"""Building this package's hand-written C++ kernels: each source once per machine, with the
C++ compiler Inductor uses, ``-O3 -march=native``, into Inductor's cache directory
(``$TORCHINDUCTOR_CACHE_DIR``, a ``lorc`` folder), keyed by the source, the flags, the compiler
and this CPU's feature flags (``-march=native`` code may not run on another), and loaded: with
``ctypes`` for plain C functions, or against torch's headers and libraries (``links_torch``)
for a source that registers ATen ops, which loading it registers. Where a kernel cannot be
built (not x86-64, no compiler, no AVX2) the caller gets ``None``, after a warning saying why,
and computes the same thing with tensor maths."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp")
_BUILDING = threading.Lock()  # threads asking for a kernel at once build it once


def _cpu_flags() -> str:
    """This CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(l for l in lines if l.startswith(("model name", "flags"))))


def _torch_flags() -> tuple[str, ...]:
    """What compiling and linking against this torch takes: its headers (C++20, as it builds
    them), its ABI, its libraries (named after the source, which needs them)."""
    import torch
    from torch.utils.cpp_extension import include_paths, library_paths

    libraries = library_paths()
    return ("-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            *(f"-I{path}" for path in include_paths()), *(f"-L{path}" for path in libraries),
            *(f"-Wl,-rpath,{path}" for path in libraries), "-lc10", "-ltorch_cpu")


def build(source: Path, purpose: str, links_torch: bool = False) -> ctypes.CDLL | None:
    """The library compiled from ``source`` (built the first time on this machine) and loaded,
    or None where it cannot be, with one warning that the ``purpose`` keeps tensor maths.
    ``links_torch``: built against torch (its version is part of the key)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import torch
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    compiler = get_cpp_compiler()
    flags = FLAGS + _torch_flags() if links_torch else FLAGS
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(flags).encode(),
                                     compiler.encode(), _cpu_flags().encode(),
                                     torch.__version__.encode() if links_torch else b""]))
    path = Path(cache_dir()) / "lorc" / f"{source.stem}-{key.hexdigest()[:20]}.so"
    with _BUILDING:
        return _built(source, purpose, compiler, flags, path)


def _built(source: Path, purpose: str, compiler: str, flags: tuple[str, ...],
           path: Path) -> ctypes.CDLL | None:
    """``source`` compiled by ``compiler`` with ``flags`` at ``path`` where it is not there
    yet, loaded."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            built = subprocess.run([compiler, str(source), *flags, "-o", str(partial)],
                                   capture_output=True, text=True)
        except OSError as error:
            built = subprocess.CompletedProcess([], 1, "", str(error))
        if built.returncode:
            log.warning("lorc_fx: the CPU kernel %s did not build (%s); %s keeps tensor maths: "
                        "%s", source.name, compiler, purpose, built.stderr.strip()[-500:])
            return None
        os.replace(partial, path)
        log.info("lorc_fx: built the CPU kernel %s into %s", source.name, path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:  # built for another torch or system: tensor maths, said once
        log.warning("lorc_fx: the CPU kernel %s at %s does not load; %s keeps tensor maths: %s",
                    source.name, path, purpose, error)
        return None
