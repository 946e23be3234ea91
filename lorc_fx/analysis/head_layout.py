"""Read head structure off index tensors that reach an attention op.

An attention input has shape ``(*lead, tokens, head_dim)`` (lead = batch, heads). Replaying
the path from a projection gives, for every element, the projection row it came from; the row
sets per lead index are the heads. Comparing the q, k and v row sets gives the head counts,
the GQA grouping and the exact weight rows of every head, whatever the fused/split layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .records import RopeLayout


@dataclass(frozen=True)
class HeadMap:
    rows: torch.Tensor        # (L, head_dim): projection row of each (lead index, dim)
    lead: tuple[int, ...]     # lead shape (batch, heads, ...)
    tokens: int               # projected (not cached) tokens per head


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_rows: tuple[int, ...]   # (head, dim) order
    k_rows: tuple[int, ...]   # (kv head, dim) order
    v_rows: tuple[int, ...]
    q_head_of_lead: tuple[int, ...]  # query head of every lead index of the query


def decode_heads(index: torch.Tensor, features: int) -> HeadMap | str:
    """Projection rows per head from an index tensor over a ``features``-wide projection."""
    if index.dim() < 3:
        return f"expected (..., tokens, head_dim), got shape {tuple(index.shape)}"
    lead, (tokens, dim) = tuple(index.shape[:-2]), index.shape[-2:]
    a = index.reshape(-1, tokens, dim)
    valid = a > 0
    full = valid.all(-1)
    if bool((valid.any(-1) & ~full).any()):
        return "a head vector mixes projected values with other values"
    if not bool(full.any(1).all()):
        return "some heads hold no projected values"
    src = (a - 1).clamp(min=0)
    feature, token = src % features, src // features
    first = full.to(torch.int8).argmax(1)
    rows = feature[torch.arange(a.shape[0]), first]
    if not bool(((feature == rows[:, None, :]) | ~valid).all()):
        return "a head dim takes different projection rows at different tokens"
    if not bool(((token == token[..., :1]) | ~valid).all()):
        return "a head vector mixes several tokens"
    return HeadMap(rows, lead, int(full[0].sum()))


def expand_kv(k: HeadMap, q: HeadMap, gqa: bool) -> HeadMap | str:
    """Align KV heads with query heads: broadcast a single KV head (MQA), or repeat each
    KV head over a group of query heads when the op groups them (``enable_gqa=True``)."""
    if k.lead == q.lead:
        return k
    if len(k.lead) != len(q.lead) or k.lead[:-1] != q.lead[:-1] or q.lead[-1] % k.lead[-1] \
            or not (gqa or k.lead[-1] == 1):
        return f"query heads {q.lead} cannot share key heads {k.lead}"
    rows = k.rows.view(*k.lead, -1).repeat_interleave(q.lead[-1] // k.lead[-1], dim=-2)
    return HeadMap(rows.reshape(-1, rows.shape[-1]), q.lead, k.tokens)


def _distinct(rows: torch.Tensor) -> tuple[list[tuple[int, ...]], list[int]]:
    ids: dict[tuple[int, ...], int] = {}
    of = [ids.setdefault(tuple(r), len(ids)) for r in rows.tolist()]
    return list(ids), of


def head_groups(q: HeadMap, k: HeadMap, v: HeadMap) -> HeadLayout | str:
    """Head counts and rows; ``k``/``v`` must already be aligned lead-for-lead with ``q``."""
    if k.rows.shape[0] != q.rows.shape[0] or v.rows.shape[0] != q.rows.shape[0]:
        return "query, key and value have different numbers of heads"
    head_dim = q.rows.shape[1]
    if k.rows.shape[1] != head_dim:
        return f"key head dim {k.rows.shape[1]} differs from query head dim {head_dim}"
    if v.rows.shape[1] != head_dim:
        return f"value head dim {v.rows.shape[1]} differs from query head dim {head_dim}"
    q_heads, q_of = _distinct(q.rows)
    groups = {}
    for name, m in (("key", k), ("value", v)):
        kv_heads, kv_of = _distinct(m.rows)
        kv_of_q: dict[int, int] = {}
        for qh, kh in zip(q_of, kv_of):
            if kv_of_q.setdefault(qh, kh) != kh:
                return f"a query head meets different {name} heads"
        order = [kv_of_q[i] for i in range(len(q_heads))]
        renumber = {kh: j for j, kh in enumerate(dict.fromkeys(order))}
        groups[name] = ([renumber[kh] for kh in order], [kv_heads[kh] for kh in renumber])
    (k_of_q, k_heads), (v_of_q, v_heads) = groups["key"], groups["value"]
    if k_of_q != v_of_q:
        return "keys and values are grouped over query heads differently"
    h, h_kv = len(q_heads), len(k_heads)
    if h % h_kv or any(j != i // (h // h_kv) for i, j in enumerate(k_of_q)):
        return f"query heads are not grouped contiguously over KV heads: {k_of_q}"
    q_rows, k_rows, v_rows = (tuple(x for head in heads for x in head)
                              for heads in (q_heads, k_heads, v_heads))
    for name, rows in (("query", q_rows), ("key", k_rows), ("value", v_rows)):
        if len(set(rows)) != len(rows):
            return f"{name} heads reuse projection rows"
    return HeadLayout(h, h_kv, head_dim, q_rows, k_rows, v_rows, tuple(q_of))


def rope_layout(index: torch.Tensor, pairs, width: int, head_dim: int) -> RopeLayout | str:
    """Rotated pairs in head-dim coordinates.

    ``index`` holds positions in the rotated tensor, whose trailing dims (``width`` elements)
    the ``pairs`` index; every head must see those dims at the same head dims.
    """
    valid = (index > 0).reshape(-1, head_dim).all(-1)
    local = ((index - 1) % width).reshape(-1, head_dim)[valid]
    if not local.shape[0] or not bool((local == local[0]).all()):
        return "RoPE dims land on different head dims in different heads"
    dim_of = {loc: e for e, loc in enumerate(local[0].tolist())}
    if len(dim_of) != head_dim:
        return "a head dim holds several rotated dims"
    try:
        head_pairs = sorted((dim_of[re], dim_of[im]) for re, im in pairs)
    except KeyError:
        return "some rotated dims do not reach the attention"
    return classify_pairs(head_pairs)


def classify_pairs(pairs: list[tuple[int, int]]) -> RopeLayout | str:
    dims = sorted(x for p in pairs for x in p)
    r = len(dims)
    if dims != list(range(r)):
        return f"RoPE rotates head dims {dims}, not the leading dims of a head"
    half = r // 2
    for style, canonical in (("half", [(t, t + half) for t in range(half)]),
                             ("interleaved", [(2 * t, 2 * t + 1) for t in range(half)])):
        if pairs == canonical:
            return RopeLayout(style, r)
        if sorted((im, re) for re, im in pairs) == canonical:  # turned by -θ
            return RopeLayout(style, r, turn=-1)
    return f"unrecognised RoPE pairing {pairs[:4]}..."


def output_columns_ok(index: torch.Tensor, q_head_of_lead, tokens: int, head_dim: int) -> str:
    """Empty if column ``c`` of the output projection's input is ``head * head_dim + dim``."""
    if not bool((index > 0).all()):
        return "the output projection reads values that are not attention outputs"
    src = index - 1
    lead = src // (tokens * head_dim)
    heads = torch.tensor(q_head_of_lead)[lead]
    column = heads * head_dim + src % head_dim
    expected = torch.arange(index.shape[-1])
    if not bool((column == expected).all()):
        return "the output projection's input columns are not in (head, dim) order"
    return ""
