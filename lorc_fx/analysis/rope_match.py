"""Recognise rotary position embeddings (RoPE) acting on a traced tensor.

Three spellings, each reduced to a list of rotated ``(re, im)`` pairs over the input's last
dim(s):

* ``x * cos + rot(x) * sin`` (or ``- rot'(x) * sin``) where ``rot`` is any composition of
  layout ops and ``neg`` that maps each element to plus or minus its pair partner. Which dims
  pair up is *read off* by replaying ``rot`` on a signed index tensor, so rotate-half
  (``cat(-x2, x1)``) and interleaved (``stack(-x_odd, x_even).flatten``) need no separate code.
* ``view_as_real(view_as_complex(z) * freqs)``: pairs ``(2t, 2t+1)`` over ``z``'s last two dims.
* partial rotary: ``cat([rope(x[..., :r]), x[..., r:]], -1)``: parts of one ``x`` (found as
  the parts' nearest common ancestor through layout ops and RoPE), some rotated, that put
  every element of ``x`` back in place; pass-through dims are simply not in any pair.
* halves rotated apart (gpt-oss): ``a, b = chunk(x, 2, -1)``, then
  ``cat([a * cos - b * sin, b * cos + a * sin], -1)``: pairs ``(a_t, b_t)`` read off the
  replayed halves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from .fx_ops import IDENTITY_OPS, LAYOUT_OPS, arg, op_name, shape, strip_identity
from .index_replay import NotReplayable, replay_between, source_index


@dataclass(frozen=True)
class RopeMatch:
    output: Node                      # node holding the rotated tensor
    input: Node                       # node holding the tensor before rotation
    pairs: tuple[tuple[int, int], ...]  # (re, im) over the flattened trailing ``ndim`` dims
    ndim: int                         # trailing dims the pair indices run over (2: complex)
    tables: tuple[Node, ...]          # cos / sin (or complex frequency) nodes


def match_rope(node, facts) -> RopeMatch | None:
    for matcher in (_match_rotate_sum, _match_complex, _match_halves, _match_partial):
        found = matcher(node, facts)
        if found is not None:
            return found
    return None


def _mul_operands(node, facts) -> tuple[Node, Node] | None:
    """(derived operand, table) of ``derived * table``."""
    if op_name(node) != "mul" or len(node.args) != 2:
        return None
    a, b = node.args
    if facts.is_derived(a) and isinstance(b, Node) and not facts.is_derived(b):
        return a, b
    if facts.is_derived(b) and isinstance(a, Node) and not facts.is_derived(a):
        return b, a
    return None


def _match_rotate_sum(node, facts) -> RopeMatch | None:
    name = op_name(node)
    if name not in ("add", "sub") or len(node.args) != 2:
        return None
    terms = [_mul_operands(a, facts) for a in node.args]
    if None in terms:
        return None
    if name == "add":
        orders = [(terms[0], terms[1], 1), (terms[1], terms[0], 1)]
    else:
        orders = [(terms[0], terms[1], -1)]  # x * cos - rot'(x) * sin, rot' = -rot
    for (x, cos), (r, sin), sign in orders:
        x = strip_identity(x)  # x.float() * cos + rot(x) * sin
        pairs = _rotation_pairs(x, r, sign, facts)
        if pairs is not None:
            return RopeMatch(node, x, pairs, 1, (cos, sin))
    return None


def _rotation_pairs(x: Node, r: Node, sign: int, facts):
    """Pairs ``(re, im)`` if ``r = rot(x)`` with ``rot[re] = -x[im]``, ``rot[im] = x[re]``."""
    size = shape(x)
    if not size or shape(r) != size:
        return None
    index = source_index(size)
    try:
        rotated = replay_between(x, r, index, facts, allow_neg=True)
    except (NotReplayable, RuntimeError, TypeError, IndexError, ValueError):
        return None
    if not isinstance(rotated, torch.Tensor) or tuple(rotated.shape) != size:
        return None
    rotated = rotated * sign
    if bool((rotated == 0).any()):
        return None
    width = size[-1]
    src = rotated.abs() - 1
    own = index - 1
    if not bool((src // width == own // width).all()):
        return None  # mixes elements across rows, not within the last dim
    partner = (src % width).reshape(-1, width)
    negated = (rotated < 0).reshape(-1, width)
    if not bool((partner == partner[0]).all() and (negated == negated[0]).all()):
        return None
    partner, negated = partner[0].tolist(), negated[0].tolist()
    pairs = []
    for e, p in enumerate(partner):
        if p == e or partner[p] != e or negated[p] == negated[e]:
            return None
        if negated[e]:
            pairs.append((e, p))
    return tuple(pairs)


def _match_complex(node, facts) -> RopeMatch | None:
    if op_name(node) != "view_as_real":
        return None
    operands = _mul_operands(node.args[0], facts)
    if operands is None:
        return None
    z_complex, freqs = operands
    if op_name(z_complex) != "view_as_complex":
        return None
    z = z_complex.args[0]
    size = shape(z)
    if not size or size[-1] != 2 or shape(node) != size:
        return None
    pairs = tuple((2 * t, 2 * t + 1) for t in range(size[-2]))
    return RopeMatch(node, z, pairs, 2, (freqs,))


def _match_halves(node, facts) -> RopeMatch | None:
    """``cat([a * cos - b * sin, b * cos + a * sin], -1)`` with ``a`` and ``b`` parts of one
    ``x`` that the ``cat`` puts back in place: each ``(a_t, b_t)`` turns by its angle."""
    if op_name(node) != "cat":
        return None
    pieces, out = arg(node, 0, "tensors"), shape(node)
    if out is None or arg(node, 1, "dim", 0) not in (-1, len(out) - 1) or len(pieces) != 2:
        return None
    first, second = pieces
    if op_name(first) != "sub" or op_name(second) != "add":
        return None
    a_cos, b_sin = (_mul_operands(t, facts) for t in first.args)
    terms = [_mul_operands(t, facts) for t in second.args]
    if None in (a_cos, b_sin, *terms):
        return None
    (a, cos), (b, sin) = a_cos, b_sin
    if set(terms) != {(b, cos), (a, sin)}:
        return None
    chains = [_trace_part(a, facts)[0], _trace_part(b, facts)[0]]
    base = next((n for n in chains[0] if n in chains[1] and shape(n) == out), None)
    if base is None:
        return None
    index = source_index(out)
    try:
        at_a, at_b = (replay_between(base, x, index, facts, False) for x in (a, b))
        if not torch.equal(torch.cat([at_a, at_b], -1), index):
            return None
    except (NotReplayable, RuntimeError, TypeError, IndexError, ValueError):
        return None
    last = out[-1]
    cols_a = ((at_a - 1) % last).reshape(-1, at_a.shape[-1])
    cols_b = ((at_b - 1) % last).reshape(-1, at_b.shape[-1])
    if not bool((cols_a == cols_a[0]).all() and (cols_b == cols_b[0]).all()):
        return None
    return RopeMatch(node, base, tuple(zip(cols_a[0].tolist(), cols_b[0].tolist())), 1,
                     (cos, sin))


def _match_partial(node, facts) -> RopeMatch | None:
    """``cat`` along the last dim of rotated and pass-through parts of one tensor ``x``.

    Each part is traced back through layout ops and RoPE to the nearest common ancestor
    ``x``; replaying with every RoPE as identity must put each element of ``x`` back in its
    place, and each RoPE's pairs are mapped to ``x``'s last-dim coordinates.
    """
    if op_name(node) != "cat":
        return None
    pieces = arg(node, 0, "tensors")
    out = shape(node)
    dim = arg(node, 1, "dim", 0)
    if out is None or dim not in (-1, len(out) - 1) or len(pieces) < 2:
        return None
    if not all(facts.is_derived(p) for p in pieces):
        return None
    chains = [_trace_part(p, facts) for p in pieces]
    common = set.intersection(*(set(visited) for visited, _ in chains))
    base = next((n for n in chains[0][0] if n in common), None)
    if base is None or shape(base) != out:
        return None
    ropes = [r for visited, found in chains for r in found
             if visited.index(r.output) < visited.index(base)]
    if not ropes:
        return None
    identities = {r.output: r.input for r in ropes}
    index = source_index(out)
    try:
        if not torch.equal(replay_between(base, node, index, facts, False, identities), index):
            return None
        pairs = [p for r in ropes for p in _pairs_in_base(r, base, index, facts, identities)]
    except (NotReplayable, RuntimeError, TypeError, IndexError, ValueError):
        return None
    tables = tuple(t for r in ropes for t in r.tables)
    return RopeMatch(node, base, tuple(sorted(pairs)), 1, tables)


def _trace_part(node, facts, limit: int = 16) -> tuple[list[Node], list[RopeMatch]]:
    """Nodes back from ``node`` through single-input layout ops and RoPE; the RoPEs met."""
    visited, ropes = [], []
    for _ in range(limit):
        visited.append(node)
        if facts.projection(node) is not None:
            break
        rope = match_rope(node, facts)
        if rope is not None:
            ropes.append(rope)
            node = rope.input
        elif (op_name(node) in LAYOUT_OPS or op_name(node) in IDENTITY_OPS) \
                and op_name(node) not in ("cat", "stack") and facts.is_derived(node.args[0]):
            node = node.args[0]
        else:
            break
    return visited, ropes


def _pairs_in_base(rope: RopeMatch, base: Node, index, facts, identities):
    """``rope``'s pairs as last-dim coordinates of ``base``, the same for every row."""
    at_input = replay_between(base, rope.input, index, facts, False, identities)
    size = tuple(at_input.shape)
    width = math.prod(size[len(size) - rope.ndim:])
    src = (at_input - 1).reshape(-1, width)
    last = index.shape[-1]
    cols = src % last
    if not bool((cols == cols[0]).all() and (src // last == src[:, :1] // last).all()):
        raise ValueError("RoPE pairs span several rows")
    cols = cols[0].tolist()
    return [(cols[re], cols[im]) for re, im in rope.pairs]
