"""Walk back from an attention input to the projection it comes from.

The walk is a chain of *steps*; each step is recognised by a small matcher, tried in order:

``rope``   rotary embedding (see ``rope_match``)
``scale``  multiplication / division by a constant (OPT's pre-scaled query)
``token_scale``  multiplication by one value per batch row and token (Llama 4's temperature)
``layout`` view / reshape / transpose / split / getitem / expand / casts ...
``cache``  ``cat`` with cached keys, or an in-place write into a cache buffer (StaticCache)
``norm``   an elementwise region with a reduction over the last dim (q/k RMSNorm)
``other``  any other shape-preserving elementwise region

Layout and cache steps are replayed on index tensors; the others keep every element in place
(they mix values within a position at most), so the replay treats them as identity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from .fx_ops import IDENTITY_OPS, LAYOUT_OPS, NORM_OPS, arg, op_name, scalar_constant, shape
from .index_replay import replay_node, source_index
from .projections import LinearNode
from .rope_match import RopeMatch, match_rope

TRANSFORMS = frozenset({"rope", "scale", "token_scale", "norm", "other"})
_WRITES = {"index_copy_": 3, "copy_": 1}  # in-place cache writes -> position of the source
_MAX_STEPS = 200
_MAX_REGION = 64


@dataclass(frozen=True)
class Step:
    kind: str                      # layout | cache | rope | scale | token_scale | norm | other
    node: Node                     # holds the traced tensor after this step
    source: Node                   # held it before
    factor: float = 1.0            # scale steps
    rope: RopeMatch | None = None  # rope steps
    write: Node | None = None      # cache steps that write in place (the write node)
    ops: tuple[str, ...] = ()      # norm / other steps: the ops in the region


@dataclass(frozen=True)
class Path:
    """From ``projection`` to ``end`` through ``steps`` (in execution order)."""

    end: Node
    projection: LinearNode | None
    steps: tuple[Step, ...]
    error: str = ""

    def kinds(self) -> set[str]:
        return {s.kind for s in self.steps}

    @property
    def factor(self) -> float:
        return math.prod(s.factor for s in self.steps)

    def _source(self, start: int) -> torch.Tensor:
        node = self.projection.node if start < 0 else self.steps[start].node
        return source_index(shape(node))

    def indices(self, start: int = -1):
        """Yield ``(node, index tensor)`` after each step, from the output of step ``start``.

        ``start=-1`` starts at the projection's output. Index values are 1 + flat positions in
        that starting tensor, 0 where an element comes from elsewhere (cached keys).
        """
        value = self._source(start)
        for step in self.steps[start + 1:]:
            value = _advance(step, value)
            yield step.node, value

    def index_at_end(self, start: int = -1) -> torch.Tensor:
        value = self._source(start)
        for step in self.steps[start + 1:]:
            value = _advance(step, value)
        return value


def _advance(step: Step, value):
    if step.kind in TRANSFORMS:
        if tuple(value.shape) != shape(step.node):
            raise ValueError(f"{step.node.name} changes the shape of what it transforms")
        return value
    if step.write is not None:
        return _emulate_write(step, value)
    return replay_node(step.node, {step.source: value})


def _emulate_write(step: Step, value: torch.Tensor) -> torch.Tensor:
    """A cache buffer after a write; new tokens are placed first (positions are data)."""
    out = torch.zeros(shape(step.node), dtype=torch.long)
    if op_name(step.write) == "copy_":
        return out.copy_(value)
    dim = step.write.args[1]
    out.narrow(dim, 0, value.shape[dim]).copy_(value)
    return out


def walk_back(end: Node, facts) -> Path:
    """The path from the projection feeding ``end`` to ``end``, or one with ``error`` set."""
    steps: list[Step] = []
    node = end
    while len(steps) < _MAX_STEPS:
        proj = facts.projection(node)
        if proj is not None:
            return Path(end, proj, tuple(reversed(steps)))
        step = _next_step(node, facts, end)
        if isinstance(step, str):
            return Path(end, None, tuple(reversed(steps)), step)
        steps.append(step)
        node = step.source
    return Path(end, None, tuple(reversed(steps)), f"no projection within {_MAX_STEPS} ops")


def describe(node) -> str:
    return f"{node.name} ({op_name(node) or node.op})"


def _next_step(node: Node, facts, end: Node) -> Step | str:
    if not facts.is_derived(node):
        return (_cache_write(node, facts, end) or _read_of_written(node, facts, end)
                or f"{describe(node)} does not depend on any projection")
    for matcher in (_rope, _scale, _layout):
        step = matcher(node, facts)
        if step is not None:
            return step
    return _region(node, facts)


def _rope(node, facts) -> Step | None:
    rope = match_rope(node, facts)
    return Step("rope", node, rope.input, rope=rope) if rope is not None else None


def _scale(node, facts) -> Step | None:
    name = op_name(node)
    if name not in ("mul", "div") or len(node.args) != 2:
        return None
    a, b = node.args
    if name == "mul" and (factor := _per_token_factor(a, b, facts)) is not None:
        return Step("token_scale", node, b if factor is a else a)
    if facts.is_derived(a) and scalar_constant(b) is not None:
        c = scalar_constant(b)
        if name == "mul" or c != 0:
            return Step("scale", node, a, factor=c if name == "mul" else 1.0 / c)
    if name == "mul" and facts.is_derived(b) and scalar_constant(a) is not None:
        return Step("scale", node, b, factor=scalar_constant(a))
    return None


def _per_token_factor(a, b, facts) -> Node | None:
    """The operand of ``a * b`` that scales the other, derived one by a tensor no projection
    feeds and that is one value across the head dim (Llama 4's attention temperature,
    ``q · (1 + β log(1 + ⌊pos / L⌋))`` shaped ``(b, 1, n, 1)``), if one does. Only a
    query may be scaled so (``attention_match``): attention reads it as it comes."""
    for factor, scaled in ((a, b), (b, a)):
        if isinstance(factor, Node) and facts.is_derived(scaled) and not facts.is_derived(factor):
            dims = shape(factor) or ()
            if dims and dims[-1] == 1 and len(dims) == len(shape(scaled) or ()):
                return factor
    return None


def _layout(node, facts) -> Step | str | None:
    name = op_name(node)
    if name not in LAYOUT_OPS and name not in IDENTITY_OPS:
        return None
    if name in ("cat", "stack"):
        pieces = list(arg(node, 0, "tensors"))
        derived = [p for p in pieces if facts.is_derived(p)]
        if len(derived) != 1:
            return f"{describe(node)} joins several projected tensors"
        kind = "cache" if name == "cat" and len(pieces) > 1 else "layout"
        return Step(kind, node, derived[0])
    source = node.args[0] if node.args else None
    if not facts.is_derived(source):
        return f"{describe(node)}: first operand does not depend on a projection"
    return Step("layout", node, source)


def _cache_write(node: Node, facts, end: Node) -> Step | None:
    """A cache buffer filled in place (``index_copy_``) before the attention reads it."""
    writes = [u for u in node.users
              if op_name(u) in _WRITES and u.args and u.args[0] is node
              and len(u.args) > _WRITES[op_name(u)]
              and facts.is_derived(u.args[_WRITES[op_name(u)]])
              and facts.order[u] < facts.order[end]]
    if not writes:
        return None
    write = max(writes, key=facts.order.__getitem__)
    return Step("cache", node, write.args[_WRITES[op_name(write)]], write=write)


def _read_of_written(node: Node, facts, end: Node) -> Step | None:
    """A layout op reading a cache buffer that is written in place (``keys[:, :, :n]``)."""
    root = node
    while op_name(root) in LAYOUT_OPS or op_name(root) in IDENTITY_OPS:
        root = root.args[0]
        if _cache_write(root, facts, end) is not None:
            return Step("layout", node, node.args[0])
    return None


def _region(node: Node, facts) -> Step | str:
    """A shape-preserving elementwise region fed by one traced tensor: ``norm`` or ``other``."""
    region: set[Node] = set()
    frontier: list[Node] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        if len(region) > _MAX_REGION:
            return f"{describe(node)}: no projection found within {_MAX_REGION} elementwise ops"
        for a in facts.derived_inputs(n):
            if a in region or a in frontier:
                continue
            (frontier if _is_boundary(a, facts) else stack).append(a)
    if len(frontier) != 1:
        names = ", ".join(describe(f) for f in frontier)
        return f"{describe(node)} combines several projected tensors ({names})"
    source = frontier[0]
    if shape(source) != shape(node):
        return f"{describe(node)} changes shape {shape(source)} -> {shape(node)}"
    ops = tuple(sorted({op_name(n) for n in region}))
    kind = "norm" if NORM_OPS.intersection(ops) else "other"
    return Step(kind, node, source, ops=ops)


def _is_boundary(node, facts) -> bool:
    """Where a region stops: casts stay inside (a norm casts to float32 and back)."""
    return (facts.projection(node) is not None or op_name(node) in LAYOUT_OPS
            or match_rope(node, facts) is not None)
