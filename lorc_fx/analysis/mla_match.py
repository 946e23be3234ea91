"""MLA's per-step expansion of its cached latent, found by data flow in a torch-level graph,
with no model class named (the rewrite that reads it absorbed: ``compile.passes.absorb_mla``).

Pattern (transformers' ``expand_kv`` of DeepSeek-V3 and the families built from it)::

    kv = linear(c, W).view(b, n, h, d_n + d_v).transpose(1, 2)   # c: (b, 1, n, r), no bias
    k_nope, v = split(kv, [d_n, d_v], dim=-1)
    k = new_empty(b, h, n, d_n + d_r)
    k[..., :d_n].copy_(k_nope); k[..., d_n:].copy_(k_r.expand(-1, h, -1, -1))
        # or k = cat([k_nope, k_r.expand(-1, h, -1, -1)], dim=-1)
    out = sdpa(q, k, v, ...)                                      # k_r: (b, 1, n, d_r)
        # or, in manual attention, p = f(matmul(q, k.transpose(2, 3))); out = matmul(p, v)

(``q`` is ``cat([q_nope, q_rope])`` with RoPE on the second part, or one projection where the
model has no RoPE: Kimi-Linear.) Invariants of a match: the query's heads are the ``h`` the
expansion makes (no ``repeat_kv`` between), it is as wide as the key, the joined key feeds
this attention alone (its slices' copies can go with it), the linear has no bias, and no
dropout. Anything else is no match.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch.fx import Node

from .fx_ops import arg, op_name, shape


@dataclass(frozen=True)
class MlaMatch:
    query: Node      # (b, h, t, d_n + d_r): its first d_n dims meet the latent's keys
    latent: Node     # c (b, 1, n, r)
    rope_key: Node   # k_r (b, 1, n, d_r)
    weight: Node     # W (h·(d_n + d_v), r)
    nope_dim: int    # d_n
    expansion: tuple[Node, ...]  # the value, the key's join and its copies


def match_mla(sdpa: Node) -> MlaMatch | None:
    """The MLA expansion an SDPA node reads, or None."""
    if op_name(sdpa) != "scaled_dot_product_attention" or arg(sdpa, 4, "dropout_p", 0.0):
        return None
    query, key, value = (arg(sdpa, i, name) for i, name in enumerate(("query", "key", "value")))
    return _match(query, key, value, sdpa)


def match_manual_mla(sums: Node) -> tuple[MlaMatch, Node] | None:
    """``(match, scores)`` where ``sums`` is manual attention's ``matmul(p, v)`` over MLA's
    expanded values and ``scores`` the ``matmul(q, k.transpose(2, 3))`` of its keys, or None.
    Whatever lies between the two (scale, mask, softcap, sink logits, softmax) stays."""
    if op_name(sums) != "matmul" or len(sums.args) != 2:
        return None
    key = _key_of(sums.args[1])
    users = list(key.users) if key is not None else []
    transposed = [u for u in users if op_name(u) == "transpose"]
    if len(transposed) != 1 or sorted(transposed[0].args[1:3]) not in ([2, 3], [-2, -1]) \
            or len(transposed[0].users) != 1:
        return None
    scores = next(iter(transposed[0].users))
    if op_name(scores) != "matmul" or scores.args[1:] != (transposed[0],):
        return None
    match = _match(scores.args[0], key, sums.args[1], transposed[0])
    if match is None:
        return None
    return replace(match, expansion=(*match.expansion, transposed[0])), scores


def _key_of(value) -> Node | None:
    """The key joined beside MLA's expanded ``value`` (the buffer its first part is copied
    into, or the ``cat`` that takes it), found from the value's split."""
    part = _split_part(value)
    if part is None or part[1] != 1:
        return None
    firsts = [u for u in part[0].users if op_name(u) == "getitem" and u.args[1] == 0]
    readers = [r for f in firsts for r in f.users]
    joins = {w.args[0].args[0] if op_name(w) == "copy_" else w for w in readers
             if op_name(w) == "cat" or (op_name(w) == "copy_" and op_name(w.args[0]) == "getitem")}
    return joins.pop() if len(joins) == 1 else None


def _match(query, key, value, reader: Node) -> MlaMatch | None:
    """The match for attention reading ``query``, ``key`` (through ``reader`` alone) and
    ``value``."""
    part = _split_part(value)
    if part is None or part[1] != 1 or not isinstance(key, Node):
        return None
    expansion = _expansion(part[0])
    if expansion is None:
        return None
    latent, weight, heads, d_n = expansion
    joined = _key_parts(key, d_n, reader)
    if joined is None or _split_part(joined[0]) != (part[0], 0):
        return None
    rope_key = _rope_key(joined[1], heads)
    shapes = shape(query), shape(rope_key)
    if rope_key is None or None in shapes or len(shapes[0]) != 4 or shapes[0][1] != heads \
            or shapes[0][-1] != d_n + shapes[1][-1]:
        return None
    return MlaMatch(query, latent, rope_key, weight, d_n, (value, *joined[2]))


def _last_dim(node: Node, dim_at: int) -> bool:
    return arg(node, dim_at, "dim", 0) in (-1, 3)


def _joined_last(node) -> bool:
    """``cat([a, b], dim=-1)``."""
    return op_name(node) == "cat" and _last_dim(node, 1) and len(node.args[0]) == 2


def _split_part(node) -> tuple[Node, int] | None:
    """``(split, index)`` for ``split(x, sizes, dim=-1)[index]``."""
    if op_name(node) != "getitem" or op_name(node.args[0]) != "split" \
            or not _last_dim(node.args[0], 2):
        return None
    return node.args[0], node.args[1]


def _expansion(split: Node):
    """``(latent, weight, heads, d_n)`` where ``split`` cuts ``linear(latent, weight)``,
    viewed ``(b, n, h, d_n + d_v)`` and transposed heads first, in two; else None."""
    sizes = split.args[1]
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2
            and all(isinstance(s, int) for s in sizes)):
        return None
    transposed = split.args[0]
    if op_name(transposed) != "transpose" or sorted(transposed.args[1:3]) != [1, 2]:
        return None
    view = transposed.args[0]
    linear = view.args[0] if op_name(view) in ("view", "reshape") else None
    if op_name(linear) != "linear" or arg(linear, 2, "bias") is not None:
        return None
    latent, weight = linear.args[:2]
    latent_shape, view_shape = shape(latent), shape(view)
    if latent_shape is None or view_shape is None or len(latent_shape) != 4 \
            or latent_shape[1] != 1 or len(view_shape) != 4 or view_shape[-1] != sum(sizes):
        return None
    return latent, weight, view_shape[2], sizes[0]


def _rope_key(node, heads: int) -> Node | None:
    """``k_r`` of ``k_r.expand(-1, heads, -1, -1)``, ``k_r`` one head ``(b, 1, n, d_r)``."""
    if op_name(node) != "expand":
        return None
    source = node.args[0]
    shapes = shape(source), shape(node)
    if None in shapes or shapes[0][1] != 1 or shapes[1][1] != heads:
        return None
    return source


def _key_parts(key, d_n: int, reader: Node):
    """``(k_nope, k_r expanded, nodes)`` of a key joined from the two for ``reader`` alone,
    ``nodes`` the join's own (the buffer, its slices and their copies); None otherwise."""
    if _joined_last(key):
        return (*key.args[0], (key,)) if len(key.users) == 1 else None
    if op_name(key) != "new_empty":
        return None
    copied, nodes = {}, [key]
    for user in key.users:
        if user is reader:
            continue
        index = user.args[1] if op_name(user) == "getitem" else None
        writes = list(user.users)
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
                and isinstance(index[1], slice) and len(writes) == 1
                and op_name(writes[0]) == "copy_" and writes[0].args[0] is user):
            return None
        copied[(index[1].start, index[1].stop, index[1].step)] = writes[0].args[1]
        nodes += [user, writes[0]]
    nope, rope = copied.get((None, d_n, None)), copied.get((d_n, None, None))
    if len(copied) != 2 or nope is None or rope is None:
        return None
    return nope, rope, tuple(nodes)
