"""Replay a graph's layout ops on integer *index tensors*.

An index tensor has the shape of a real activation; each element holds ``1 +`` the flat
position of the element it came from in a chosen source tensor (``0``: not from the source,
e.g. cached keys joined by ``cat``; negative: negated, used to recognise rotate-half).
Running the model's own view / transpose / split / chunk / cat / expand ops on these tensors
says exactly where every element of a projection lands, for any mix of layout ops, instead of
pattern-matching each spelling of "split heads".
"""
from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from .fx_ops import IDENTITY_OPS, LAYOUT_OPS, concrete, example, op_name, shape

# Layout ops that may take tensors other than the traced one (filled with zeros).
_TAKES_OTHER_TENSORS = frozenset({"cat", "stack", "view_as", "reshape_as", "expand_as"})
_MAX_REGION = 64


class NotReplayable(Exception):
    """The node is not a pure layout op (or reads data it cannot see)."""


def source_index(size) -> torch.Tensor:
    """Index tensor naming every element of a source of shape ``size`` (1-based)."""
    n = 1
    for s in size:
        n *= s
    return torch.arange(1, n + 1, dtype=torch.long).view(tuple(size))


def replay_node(node: Node, env: dict, allow_neg: bool = False):
    """Evaluate one layout op with traced inputs from ``env``, other tensors as zero fillers."""
    name = op_name(node)
    fillers = []

    def substitute(a: Node):
        if a in env:
            return env[a]
        v = example(a)
        if isinstance(v, torch.Tensor):
            fillers.append(a)
            return torch.zeros(shape(a), dtype=torch.long)
        if v is None:
            raise NotReplayable(f"{a.name} has no recorded value")
        return concrete(v)

    args = map_arg(node.args, substitute)
    kwargs = map_arg(node.kwargs, substitute)
    if name in IDENTITY_OPS:
        return args[0]
    if name == "neg" and allow_neg:
        return -args[0]
    if name not in LAYOUT_OPS:
        raise NotReplayable(f"{node.name} ({name}) is not a layout op")
    if fillers and name not in _TAKES_OTHER_TENSORS:
        raise NotReplayable(f"{node.name} ({name}) reads tensor {fillers[0].name}")
    if name == "view":
        # The real op succeeded, so reshape gives the same result; our index tensors may not
        # be contiguous where the model's were (``contiguous`` is replayed as identity).
        if any(isinstance(a, torch.dtype) for a in args[1:]):
            raise NotReplayable(f"{node.name} reinterprets the dtype")
        return args[0].reshape(*args[1:], **kwargs)
    if node.op == "call_method":
        return getattr(args[0], name)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def replay_between(src: Node, dst: Node, value: torch.Tensor, facts, allow_neg: bool = False,
                   identities: dict[Node, Node] | None = None):
    """Index tensor of ``dst`` when ``src`` holds ``value``; every op between must be layout.

    The region is every derived node on a path from ``src`` to ``dst``; it may branch and
    join (``cat(-x2, x1)``) but must not reach another projection. ``identities`` maps nodes
    that keep their input's layout (a recognised RoPE) to that input.
    """
    identities = identities or {}
    region: set[Node] = set()
    stack = [dst]
    while stack:
        n = stack.pop()
        if n is src or n in region:
            continue
        if not facts.is_derived(n) or facts.projection(n) is not None:
            raise NotReplayable(f"{dst.name} does not come from {src.name} by layout ops")
        region.add(n)
        if len(region) > _MAX_REGION:
            raise NotReplayable(f"too many ops between {src.name} and {dst.name}")
        stack.extend([identities[n]] if n in identities else facts.derived_inputs(n))
    env = {src: value}
    for n in sorted(region, key=facts.order.__getitem__):
        env[n] = env[identities[n]] if n in identities else replay_node(n, env, allow_neg)
    return env[dst]
