"""Small helpers shared by the rewrite passes."""
from __future__ import annotations

import operator

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
        if (node.graph is graph and not node._erased and not node.users
                and node.op in ("call_function", "call_method")):
            inputs = [n for n in node.all_input_nodes]
            graph.erase_node(node)
            pending.extend(inputs)


def replace_call(graph: fx.Graph, node: fx.Node, function, args, kwargs=None) -> fx.Node:
    """A call of ``function`` in ``node``'s place: its users and meta moved over, ``node``
    erased (what fed only it is the caller's to erase)."""
    with graph.inserting_before(node):
        new = graph.call_function(function, tuple(args), kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


_FUNCTIONS = {torch.Tensor.expand: "expand", torch.reshape: "reshape",
              torch.unsqueeze: "unsqueeze", operator.getitem: "getitem"}


def _op(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    return _FUNCTIONS.get(node.target) if node.op == "call_function" else None


def strip_repeat_kv(node: fx.Node) -> fx.Node:
    """Walk back through ``repeat_kv`` (``x[:, :, None].expand(...).reshape(...)``).

    ``repeat_kv`` puts the ``n_rep`` copies of each KV head next to each other, so query head
    ``i`` reads KV head ``i // n_rep``: the grouping of SDPA's ``enable_gqa`` and of the
    absorbed form. The walk passes ``contiguous``, ``expand``, a reshape/view of an expand,
    and one new axis right after the head axis; anything else ends it. A new axis before the
    heads (``x[:, None].expand(...).reshape(...)``) tiles them instead, head ``i`` reading
    KV head ``i % h_kv``, which the absorbed form does not compute.
    """
    while True:
        op = _op(node)
        if op == "contiguous" or op == "expand":
            node = node.args[0]
        elif op in ("reshape", "view") and _op(_skip_contiguous(node.args[0])) == "expand":
            node = node.args[0]
        elif op == "unsqueeze" and _unsqueeze_dim(node) in (2, -3):
            node = node.args[0]
        elif op == "getitem" and _inserts_axis_after_heads(node.args[1]):
            node = node.args[0]
        else:
            return node


def _skip_contiguous(node):
    while isinstance(node, fx.Node) and _op(node) == "contiguous":
        node = node.args[0]
    return node


def _unsqueeze_dim(node: fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _inserts_axis_after_heads(index) -> bool:
    """``x[:, :, None]`` (or ``x[..., None, :, :]`` of a 4-d ``(b, h_kv, n, d)``): slices that
    keep everything plus one new axis at dim 2."""
    if not isinstance(index, tuple) or sum(i is None for i in index) != 1:
        return False
    if not all(i is None or i is Ellipsis or i == slice(None) for i in index):
        return False
    at = next(k for k, i in enumerate(index) if i is None)
    if any(i is Ellipsis for i in index[:at]):
        return len(index) - at - 1 == 2
    return at == 2
