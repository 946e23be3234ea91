"""Recognise weight projections (linear layers) in a torch-level FX graph.

A projection is an op that multiplies an activation by a model parameter: ``linear``,
``addmm`` (GPT-2 ``Conv1D``, weight stored ``(in, out)``) or ``x @ W`` / ``x @ W.T``, the
last optionally followed by ``+ bias``.
Which parameter it is comes from ``param_names`` (placeholder name -> parameter name), i.e.
from the identity of the parameter tensors, never from the model's module names.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from .fx_ops import arg, op_name, shape, strip_identity, scalar_constant

_TRANSPOSES = frozenset({"t", "transpose"})
_LOCAL_SHARD = "to_local"  # a tensor-parallel weight read as this process's shard


@dataclass(frozen=True)
class LinearNode:
    node: Node            # the projection's output node
    input: Node           # the activation it multiplies
    weight: str           # parameter name of the weight
    bias: str | None      # parameter name of the bias, if the op adds one
    transposed: bool      # weight stored (in, out)
    out_features: int


def param_name(node, param_names: dict[str, str]) -> str | None:
    """Parameter name of a placeholder / get_attr node (through casts), else ``None``."""
    node = strip_identity(node)
    if op_name(node) == _LOCAL_SHARD and node.args and isinstance(node.args[0], Node):
        node = strip_identity(node.args[0])
    if not isinstance(node, Node):
        return None
    if node.op == "placeholder":
        return param_names.get(node.name)
    if node.op == "get_attr":
        return param_names.get(node.name, param_names.get(node.target))
    return None


def _weight(node, param_names) -> tuple[str, bool] | None:
    """(name, is_transposed_view) of a weight operand: ``W``, ``W.t()`` or ``W.T``."""
    name = param_name(node, param_names)
    if name is not None:
        return name, False
    transposed = op_name(node) in _TRANSPOSES or (
        op_name(node) == "getattr" and node.args[1] in ("T", "mT"))
    if transposed and shape(node) is not None and len(shape(node)) == 2:
        name = param_name(node.args[0], param_names)
        if name is not None:
            return name, True
    return None


def _with_bias(node, param_names) -> LinearNode | None:
    """``x @ W.T + b``: a bias-free matmul projection plus a parameter vector."""
    if op_name(node) != "add" or len(node.args) != 2:
        return None
    for inner, b in (node.args, node.args[::-1]):
        proj = as_projection(inner, param_names)
        bias = param_name(b, param_names)
        if proj is not None and proj.bias is None and bias is not None \
                and shape(b) == (proj.out_features,):
            return LinearNode(node, proj.input, proj.weight, bias, proj.transposed,
                              proj.out_features)
    return None


def as_projection(node, param_names: dict[str, str]) -> LinearNode | None:
    """A ``LinearNode`` if ``node`` multiplies an activation by a parameter."""
    name = op_name(node)
    out = shape(node)
    if name is None or out is None:
        return None
    if name == "linear":
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        weight = param_name(w, param_names)
        bias = param_name(b, param_names) if b is not None else None
        if weight is None or (b is not None and bias is None):
            return None
        return LinearNode(node, x, weight, bias, False, out[-1])
    if name == "addmm":
        b, x, w = node.args[:3]
        if any(scalar_constant(node.kwargs.get(k, 1)) != 1.0 for k in ("beta", "alpha")):
            return None
        weight, bias = param_name(w, param_names), param_name(b, param_names)
        if weight is None or bias is None:
            return None
        return LinearNode(node, x, weight, bias, True, out[-1])
    if name == "add":
        return _with_bias(node, param_names)
    if name in ("matmul", "mm"):
        x, w = node.args[:2]
        found = _weight(w, param_names)
        if found is None or param_name(x, param_names) is not None:
            return None
        weight, t_view = found
        return LinearNode(node, x, weight, None, not t_view, out[-1])
    return None
