"""A small vocabulary over torch-level FX nodes (what dynamo hands a backend).

Ops are recognised by name (``call_method`` target or the function's ``__name__``), never
by module or class names of the model.
"""
from __future__ import annotations

import torch
from torch.fx import Node

_ALIASES = {
    "truediv": "div", "itruediv": "div", "iadd": "add", "imul": "mul", "isub": "sub",
    "concat": "cat", "concatenate": "cat", "moveaxis": "movedim", "swapaxes": "transpose",
    "swapdims": "transpose", "multiply": "mul", "divide": "div", "subtract": "sub",
    "negative": "neg",
}

# Ops that only move, copy or re-type elements: replayable on integer index tensors.
LAYOUT_OPS = frozenset({
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "flatten",
    "unflatten", "split", "chunk", "unbind", "narrow", "t", "movedim", "repeat",
    "repeat_interleave", "select", "tensor_split", "split_with_sizes", "getitem", "cat",
    "stack", "view_as", "reshape_as", "expand_as",
})
# Ops that leave the elements where they are (casts, copies, inference-mode dropout).
IDENTITY_OPS = frozenset({
    "to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone",
    "detach", "dropout", "cpu", "cuda",
})
# Reductions over the last dim: their presence makes an elementwise region a normalisation.
NORM_OPS = frozenset({
    "mean", "sum", "var", "std", "norm", "var_mean", "vector_norm", "linalg_vector_norm",
    "layer_norm", "rms_norm", "group_norm", "amax",
})
_MATMULS = frozenset({"matmul", "bmm", "mm"})


def op_name(node) -> str | None:
    """``view``, ``add``, ``linear``... for call nodes, ``None`` for anything else."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return _ALIASES.get(name, name)


def example(node):
    """The fake value dynamo recorded for a node (``None`` if there is none)."""
    if not isinstance(node, Node):
        return None
    meta = node.meta
    return meta.get("example_value", meta.get("val"))


def shape(node) -> tuple[int, ...] | None:
    v = example(node)
    return tuple(concrete(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def concrete(v):
    """A python value for an int/float/SymInt (its hint); other values unchanged."""
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return v.node.hint
    return v


def scalar_constant(arg) -> float | None:
    """The value of a python number, or of a 0-d constant tensor built in the graph."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    name = op_name(arg)
    if name == "full" and tuple(arg.args[0]) == () and not isinstance(arg.args[1], Node):
        return float(arg.args[1])
    if name == "tensor" and isinstance(arg.args[0], (int, float)):
        return float(arg.args[0])
    if name in IDENTITY_OPS and arg.args:
        return scalar_constant(arg.args[0])
    return None


def arg(node: Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_matmul(node) -> bool:
    return op_name(node) in _MATMULS


def strip_identity(node):
    """Follow casts / copies back to the node they re-type."""
    while op_name(node) in IDENTITY_OPS and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node
