"""``lorc_backend``: the torch.compile backend.

analyse graph → plan ranks → rewrite → Inductor. On a model prepared by
``lorc_fx.compress`` the graph already reads latents from the cache; the rewrite absorbs the
bases into query and output. On an uncompressed model the backend plans from the graph's own
weights with its options and compresses every cache-free attention itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx

from passes.absorb_latent_attention import absorb_latent_attention
from passes.compress_attention import GraphCompression, compress_attention
from passes.lower_latent_ops import LATENT_OPS, lower_latent_ops

from .plan import PlanOptions

log = logging.getLogger(__name__)


@dataclass
class GraphReport:
    absorbed: int
    compression: GraphCompression | None


class LorcBackend:
    """A torch.compile backend; ``with_options(...)`` gives one with other plan options
    (``cache_fraction``, ``schedule``, ``rope``, ...) or ``inductor=False`` (run the rewritten
    graph as it is, for tests)."""

    def __init__(self, inductor: bool = True, **plan_options):
        self.inductor = inductor
        self.plan_options = PlanOptions(**plan_options)
        self.reports: list[GraphReport] = []

    def with_options(self, inductor: bool | None = None, **plan_options) -> "LorcBackend":
        merged = {**self.plan_options.__dict__, **plan_options}
        return LorcBackend(self.inductor if inductor is None else inductor, **merged)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        compression = None
        if not _has_latent_ops(gm):
            compression = compress_attention(gm, example_inputs, self.plan_options)
            for index, why in compression.left_alone:
                log.warning("lorc_backend: attention %d left uncompressed: %s", index, why)
        report = GraphReport(absorb_latent_attention(gm), compression)
        self.reports.append(report)
        lower_latent_ops(gm)
        if not self.inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


def _has_latent_ops(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in LATENT_OPS for n in gm.graph.nodes)


lorc_backend = LorcBackend()
torch._dynamo.register_backend(lorc_backend, name="lorc")
