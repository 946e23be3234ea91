"""Replace the latent cache's custom ops left in a graph by their plain-torch maths, so
Inductor can fuse them with their neighbours instead of calling them as opaque kernels."""
from __future__ import annotations

from torch import fx

from lorc_fx.cache.latent_ops import LOWERINGS


def lower_latent_ops(gm: fx.GraphModule) -> int:
    """Swap each latent op for its plain-torch maths in place; returns how many."""
    lowered = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LOWERINGS:
            node.target = LOWERINGS[node.target]
            lowered += 1
    gm.recompile()
    return lowered
