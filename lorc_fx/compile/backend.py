"""``lorc_backend``: the torch.compile backend.

graph → ``LorcPassManager`` (compress cache-free attention, absorb the bases, lower what is
left) → Inductor. On a model prepared by ``lorc_fx.compress`` the graph already reads latents
from the cache; the rewrite absorbs the bases into query and output. On an uncompressed model
the backend plans from the graph's own weights with its options and compresses every
cache-free attention itself.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

from lorc_fx.plan.options import PlanOptions

from .pass_manager import LorcPassManager, PassReport

log = logging.getLogger(__name__)


class LorcBackend:
    """A torch.compile backend; ``with_options(...)`` gives one with other plan options
    (``cache_fraction``, ``schedule``, ``rope``, ...) or ``inductor=False`` (run the rewritten
    graph as it is, for tests). ``reports`` holds one :class:`PassReport` per compiled graph."""

    def __init__(self, inductor: bool = True, **plan_options):
        self.inductor = inductor
        self.plan_options = PlanOptions(**plan_options)
        self.passes = LorcPassManager(self.plan_options)
        self.reports: list[PassReport] = []

    def with_options(self, inductor: bool | None = None, **plan_options) -> "LorcBackend":
        merged = {**self.plan_options.__dict__, **plan_options}
        return LorcBackend(self.inductor if inductor is None else inductor, **merged)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        report = self.passes(gm, example_inputs)
        self.reports.append(report)
        if report.compression is not None:
            for index, why in report.compression.left_alone:
                log.warning("lorc_backend: attention %d left uncompressed: %s", index, why)
        log.info("lorc_backend: graph %d: %s", len(self.reports), report.counts)
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


lorc_backend = LorcBackend()
torch._dynamo.register_backend(lorc_backend, name="lorc")
