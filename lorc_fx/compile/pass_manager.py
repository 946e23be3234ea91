"""The graph passes in the one order they are valid in, with what each matched.

Order and invariants (docs/design.md, "Compile invariants"):

1. ``compress_attention`` runs only on a graph that reads no latent: a model prepared by
   ``lorc_fx.compress`` already traces ``lorc::project``/``lorc::reconstruct`` from its cache,
   and compressing its attention again would project twice. On other graphs it splices
   ``reconstruct(project(·))`` into every cache-free attention, so the next pass finds them
   (with options of ``latent_bits`` < 16 it refuses: cache-free attention has no cache to
   quantize).
2. ``absorb_latent_attention`` runs before lowering: it recognises attention over latents by
   the ``lorc::reconstruct`` nodes feeding SDPA, and over quantized sides by the
   ``lorc::dequantize`` nodes, which lowering turns into plain maths.
3. ``absorb_mla`` runs before lowering too: it rewrites MLA's expansion of its cached latent
   (``linear`` by the up-projection, split, joined with the shared RoPE key) wherever it
   feeds SDPA, whatever the latent is (floats, or a quantized side's ``lorc::dequantize``,
   which it leaves for lowering).
4. ``lower_latent_ops`` runs last: whatever latent op is left (the cache's own ``project``
   on the write path, a reconstruct whose SDPA could not be absorbed) becomes plain torch
   maths that Inductor fuses with its neighbours.
5. No pass calls ``graph.eliminate_dead_code()``: FX deems ``call_method`` nodes pure and
   would delete a static cache's in-place writes. Passes erase the nodes they replace, one
   by one.

The manager is an Inductor ``CustomGraphModulePass``: its ``uuid()`` hashes the source of
every pass (their shared ``graph_utils`` included) and the plan options, the key Inductor's
caches expect of a custom pass.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphModulePass, get_hash_for_files

from lorc_fx.cache.latent_ops import LOWERINGS
from lorc_fx.plan.options import PlanOptions

from . import mla_attention
from .passes import (absorb_latent_attention, absorb_mla, compress_attention, graph_utils,
                     lower_latent_ops)
from .passes.compress_attention import GraphCompression

PASS_ORDER = ("compress_attention", "absorb_latent_attention", "absorb_mla", "lower_latent_ops")
_PASS_FILES = tuple(m.__file__ for m in (compress_attention, absorb_latent_attention,
                                         absorb_mla, lower_latent_ops, graph_utils,
                                         mla_attention)) + (__file__,)


@dataclass
class PassReport:
    """What each pass matched in one graph, in pass order; ``compression`` details the first
    pass where it ran."""

    counts: dict[str, int] = field(default_factory=dict)
    compression: GraphCompression | None = None

    @property
    def absorbed(self) -> int:
        return self.counts.get("absorb_latent_attention", 0)


def reads_latents(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in LOWERINGS for n in gm.graph.nodes)


class LorcPassManager(CustomGraphModulePass):
    def __init__(self, options: PlanOptions):
        self.options = options.concrete()  # it measures nothing: "auto" is the first choice

    def __call__(self, gm: fx.GraphModule, example_inputs=()) -> PassReport:
        """Run every pass on ``gm`` in place; ``example_inputs`` (the backend's) hold the
        parameters that cache-free attention is planned from."""
        report = PassReport()
        if reads_latents(gm):
            report.counts["compress_attention"] = 0
        else:
            if self.options.latent_bits != 16:
                raise ValueError(
                    f"latent_bits={self.options.latent_bits}: lorc_backend compresses the "
                    "attention of a graph that reads no latent cache from the graph's weights, "
                    "and such attention caches nothing to quantize; quantize the cache with "
                    "lorc_fx.compress(model, latent_bits=...) before compiling")
            report.compression = compress_attention.compress_attention(gm, example_inputs,
                                                                       self.options)
            report.counts["compress_attention"] = len(report.compression.compressed)
        report.counts["absorb_latent_attention"] = absorb_latent_attention.absorb_latent_attention(gm)
        report.counts["absorb_mla"] = absorb_mla.absorb_mla(gm)
        report.counts["lower_latent_ops"] = lower_latent_ops.lower_latent_ops(gm)
        return report

    def uuid(self) -> bytes:
        options = json.dumps(asdict(self.options), sort_keys=True, default=str).encode()
        return get_hash_for_files(_PASS_FILES, extra=options.decode())
