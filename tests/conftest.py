import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers package: `from helpers...`

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

from helpers.tiny_llama import save_tiny_llama, write_text  # noqa: E402

torch.set_num_threads(1)

# Inductor writes its C++ kernels without SIMD here (``simdlen`` 1; in the processes tests
# start, test_tensor_parallel.py's and test_gpu_suite.py's, ``TORCHINDUCTOR_VEC_ISA_OK=0``:
# no vector ISA, the same scalar kernels): the toy models' tests prove the pass's
# graphs and ops, which scalar kernels compute as vector ones do, and choosing vector tiles
# over the codes' index arithmetic is ~40% of a toy's compile on 2 cores
# (test_waterfilled_keys' Inductor test: 194 s against 346 s, alone). Tests marked
# ``vectorized`` (the real model's, one toy's 4-bit codes) compile as users' machines do (the
# fixture at the end).
inductor_config.cpp.simdlen = 1


# The tiny Llama of ``helpers.tiny_llama``, saved once per session, loaded per test with its
# own cache directory (calibration and sampled text are cached per test, never shared).
@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    text = write_text(root / "text.txt")
    return save_tiny_llama(root / "model"), text


@pytest.fixture
def loaded(tiny, tmp_path, monkeypatch):
    from lorc_fx.analysis import analyze
    from lorc_fx.data.models import load_model, load_tokenizer

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    directory, text = tiny
    model = load_model(directory)
    return model, load_tokenizer(directory), analyze(model), text


# ---------------------------------------------------------------- order and workers (pytest -n)
# README's test command runs two workers (pytest-xdist, ``-n 2``). They take the tests in the
# order below, one test at a time (the scheduler below), except that a module in KEEP_TOGETHER
# goes to one worker whole, so that its costly module fixtures are built once. The longest
# tests go first, so that both workers end together: the two compiled generates on the real
# model (minutes each) start at once, one on each worker, then the modules with slow or
# Inductor tests, then the rest. Only the order changes; every test runs as before. Whole
# modules move, so a run without workers still sets each module fixture up once.
FIRST = ("tests/test_real_model.py",)
KEEP_TOGETHER = (
    "tests/api/test_tensor_parallel.py",  # module fixtures launch torchrun three times
    "tests/kernels/test_kernels.py",  # the interpreted kernels (a module fixture, ~11 s)
    "tests/kernels/test_vector_triton.py",  # the same for the vector codes' kernels (~15 s)
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    heavy = {_module(i.nodeid) for i in items
             if i.get_closest_marker("slow") or i.get_closest_marker("inductor")}
    rank = lambda i: 0 if _module(i.nodeid) in FIRST else 1 if _module(i.nodeid) in heavy else 2
    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may not be installed
def pytest_xdist_make_scheduler(config, log):
    """With ``-n`` (xdist's default ``--dist load``): the collection's order, a test at a time,
    KEEP_TOGETHER modules whole. (Not ``--dist loadgroup``: its ``xdist_group`` marks do not
    group under pytest 9.2, whose node ids ignore the suffix xdist writes.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module(nodeid) if _module(nodeid) in KEEP_TOGETHER else nodeid

    config.option.loadscopereorder = False  # keep the order above, not the largest scope first
    return Scheduler(config, log)


@pytest.fixture(autouse=True)
def _inductor_vector_kernels(request):
    """Vectorized Inductor kernels (the width Inductor picks for this CPU) for ``vectorized``
    tests."""
    if request.node.get_closest_marker("vectorized") is None:
        yield
        return
    with inductor_config.patch({"cpp.simdlen": None}):
        yield
