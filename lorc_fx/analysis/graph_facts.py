"""Per-graph facts the matchers share: projections, node order, and which nodes are *derived*.

A node is derived when it depends on the output of some projection. Derivedness tells the
traced activation apart from what merely joins it: RoPE cos/sin tables, masks, norm weights,
cached keys from earlier steps.
"""
from __future__ import annotations

from torch.fx import Graph, Node

from .fx_ops import IDENTITY_OPS, op_name
from .projections import LinearNode, as_projection


class GraphFacts:
    def __init__(self, graph: Graph, param_names: dict[str, str]):
        self.graph = graph
        self.param_names = param_names
        self.order: dict[Node, int] = {}
        self.projections: dict[Node, LinearNode] = {}
        self.derived: set[Node] = set()
        for i, node in enumerate(graph.nodes):
            self.order[node] = i
            proj = as_projection(node, param_names)
            if proj is not None:
                self.projections[node] = proj
            if proj is not None or any(a in self.derived for a in node.all_input_nodes):
                self.derived.add(node)

    def projection(self, node) -> LinearNode | None:
        return self.projections.get(node)

    def is_derived(self, node) -> bool:
        return node in self.derived

    def derived_inputs(self, node: Node) -> list[Node]:
        """Derived inputs whose *values* flow into ``node`` (a cast's dtype reference, as in
        ``x.type_as(y)``, does not)."""
        if op_name(node) in IDENTITY_OPS and node.args and isinstance(node.args[0], Node):
            return [node.args[0]] if node.args[0] in self.derived else []
        return [a for a in node.all_input_nodes if a in self.derived]
