"""Small helpers shared by the rewrite passes."""
from __future__ import annotations

import torch
from torch import fx

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention,
                torch.nn.functional.scaled_dot_product_attention)


def fake(node: fx.Node):
    """The fake tensor dynamo recorded for ``node`` (None when it has none)."""
    return node.meta.get("example_value", node.meta.get("val"))


def erase_if_unused(graph: fx.Graph, nodes) -> None:
    """Erase nodes that lost all users, one by one and only those.

    Never ``graph.eliminate_dead_code()`` on a dynamo graph: FX deems ``call_method`` nodes
    pure and would drop the cache's in-place writes (docs/design.md, "Compile invariants").
    """
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if node.graph is graph and not node.users and node.op in ("call_function", "call_method"):
            inputs = [n for n in node.all_input_nodes]
            graph.erase_node(node)
            pending.extend(inputs)


_VIEW_METHODS = {"expand", "reshape", "view", "contiguous", "unsqueeze"}


def strip_repeat_kv(node: fx.Node) -> fx.Node:
    """Walk back through ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``)."""
    while True:
        if node.op == "call_method" and node.target in _VIEW_METHODS:
            node = node.args[0]
        elif node.op == "call_function" and node.target in (torch.Tensor.expand, torch.reshape,
                                                             torch.unsqueeze):
            node = node.args[0]
        elif node.op == "call_function" and node.target is __import__("operator").getitem \
                and _is_none_insert(node.args[1]):
            node = node.args[0]
        else:
            return node


def _is_none_insert(index) -> bool:
    """``x[:, :, None, :, :]``: slices that keep everything plus inserted axes."""
    if not isinstance(index, tuple) or None not in index:
        return False
    return all(i is None or i is Ellipsis or i == slice(None) for i in index)
