"""``lorc_backend``: the torch.compile backend.

graph → ``LorcPassManager`` (compress cache-free attention, absorb the bases, lower what is
left) → Inductor. On a model prepared by ``lorc_fx.compress`` the graph already reads latents
from the cache; the rewrite absorbs the bases into query and output, and decode steps over
quantized latents (``compress(..., latent_bits=8 or 4)``) read their codes. On an
uncompressed model the backend plans from the graph's own weights with its options and
compresses every cache-free attention itself (there is no cache to quantize there, so its
options keep ``latent_bits=16``).
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
    (a :class:`PlanOptions` or overrides of its fields: ``cache_fraction``, ``schedule``,
    ``rope``, ...) or ``inductor=False`` (run the rewritten graph as it is, for tests).
    "auto" options are taken at their first choice (``PlanOptions.concrete``: the backend
    measures nothing). ``reports`` holds one :class:`PassReport` per compiled graph."""

    def __init__(self, inductor: bool = True, options: PlanOptions | None = None, **overrides):
        self.inductor = inductor
        self.plan_options = PlanOptions.of(options, **overrides)
        self.passes = LorcPassManager(self.plan_options)
        self.reports: list[PassReport] = []
        self._said: set[str] = set()  # every message is logged once per backend

    def _once(self, level: int, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.log(level, message)

    def _say(self, report: PassReport) -> None:
        """What changed the outputs, once: attention compressed from the graph's own weights
        (the model had no ``lorc_fx.compress`` plan) and attention left alone, with why."""
        compression = report.compression
        if compression is not None and compression.compressed:
            plan = compression.plan
            self._once(logging.WARNING, (
                f"lorc_backend: the model has no lorc_fx.compress plan, so its cache-free "
                f"attention is compressed with bases from the graph's weights: "
                f"{len(compression.compressed)} blocks at cache fraction "
                f"{plan.cache_fraction:.3f} (asked {plan.budget.asked()}, "
                f"{plan.options.schedule} schedule); outputs differ from the uncompressed "
                "model's"))
        if compression is not None:
            by_reason: dict[str, list[int]] = {}
            for index, why in compression.left_alone:
                by_reason.setdefault(why, []).append(index)
            for why, indices in by_reason.items():
                self._once(logging.WARNING, f"lorc_backend: attention {', '.join(map(str, indices))} "
                                            f"left uncompressed: {why}")
        self._once(logging.INFO, f"lorc_backend: passes matched {report.counts}")

    def with_options(self, inductor: bool | None = None, **overrides) -> "LorcBackend":
        return LorcBackend(self.inductor if inductor is None else inductor, self.plan_options,
                           **overrides)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        report = self.passes(gm, example_inputs)
        self.reports.append(report)
        self._say(report)
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


lorc_backend = LorcBackend()
torch._dynamo.register_backend(lorc_backend, name="lorc")
