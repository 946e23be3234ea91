"""Match every attention block of a dynamo FX graph, down to the nodes and weight rows.

``match_attention(gm, param_names)`` works on any torch-level graph (analysis captures, or
the graphs a torch.compile backend receives, cached keys included) and returns one
``AttentionBlock`` per attention op, in graph order, with its ``GraphNodes`` (where it sits
in ``gm``) attached. Nothing here knows a model family: q, k
and v are traced back to their projections (``path_walk``), the head layout and weight rows
are read off index replays (``head_layout``), RoPE off the rotation it performs
(``rope_match``).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node

from .attention_sites import AttentionSite, find_sites
from .fx_ops import IDENTITY_OPS, LAYOUT_OPS, op_name, shape
from .graph_facts import GraphFacts
from .head_layout import (HeadLayout, HeadMap, decode_heads, expand_kv, head_groups,
                          output_columns_ok, rope_layout)
from .index_replay import NotReplayable, replay_node, source_index
from .mla_match import match_manual_mla, match_mla
from .path_walk import TRANSFORMS, Path, walk_back
from .projections import LinearNode
from .records import NO_ROPE, AttentionBlock, GraphNodes, Projection

_REPLAY_ERRORS = (NotReplayable, RuntimeError, ValueError, TypeError, IndexError)
_MAX_OUTPUT_CHAIN = 16
MLA_REASON = ("MLA: the cache already holds one latent and a RoPE key shared by the heads "
              "(lorc_backend reads it absorbed, exact)")


class _Unsupported(Exception):
    pass


def match_attention(gm: GraphModule, param_names: dict[str, str]) -> list[AttentionBlock]:
    """All attention ops of ``gm`` in graph order (``layer`` numbers them from 0).

    ``param_names`` maps placeholder (or get_attr) node names to ``model.named_parameters()``
    names; projections are only recognised on those parameters.
    """
    facts = GraphFacts(gm.graph, param_names)
    return [replace(_match_site(site, facts), layer=i)
            for i, site in enumerate(find_sites(facts))]


def _match_site(site: AttentionSite, facts: GraphFacts) -> AttentionBlock:
    m = AttentionBlock(layer=-1, q=None, k=None, v=None, o=None, num_heads=0, num_kv_heads=0,
                       head_dim=0, attention_op=site.op, supported=False,
                       nodes=GraphNodes(site.node, site.query, site.key, site.value,
                                        site.key_transposed))
    if site.softcap is not None:
        m.notes["softcap"] = site.softcap
    if site.sinks:
        m.notes["sinks"] = site.sinks
    try:
        if site.error:
            raise _Unsupported(site.error)
        _fill(m, site, facts)
        m.supported = True
    except _Unsupported as e:
        m.supported, m.reason = False, str(e)
    except Exception as e:  # an arbitrary graph must never abort the analysis
        m.supported, m.reason = False, f"matcher failed: {type(e).__name__}: {e}"
    if not m.supported and (match_mla(site.node) or match_manual_mla(site.node)) is not None:
        m.reason = MLA_REASON
    return m


def _fill(m: AttentionBlock, site: AttentionSite, facts: GraphFacts) -> None:
    traces = {}
    for role, node in (("query", site.query), ("key", site.key), ("value", site.value)):
        trace = walk_back(node, facts)
        if trace.error:
            raise _Unsupported(f"{role}: {trace.error}")
        traces[role] = trace
    m.nodes.q_trace, m.nodes.k_trace, m.nodes.v_trace = traces["query"], traces["key"], traces["value"]
    m.nodes.q_linear, m.nodes.k_linear, m.nodes.v_linear = (t.projection.node for t in traces.values())

    heads = {role: _decode(t, role, site.key_transposed and role == "key")
             for role, t in traces.items()}
    for role in ("key", "value"):
        heads[role] = _check(expand_kv(heads[role], heads["query"], site.op == "sdpa_gqa"), role)
    layout = _check(head_groups(heads["query"], heads["key"], heads["value"]), "heads")
    m.num_heads, m.num_kv_heads, m.head_dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    m.q = _projection(m.nodes.q_trace.projection, layout.q_rows)
    m.k = _projection(m.nodes.k_trace.projection, layout.k_rows)
    m.v = _projection(m.nodes.v_trace.projection, layout.v_rows)

    notes = []
    m.q_path, m.nodes.q_rope, m.rope_q = _transforms(m.nodes.q_trace, layout.head_dim, False, "query", notes)
    m.k_path, m.nodes.k_rope, m.rope_k = _transforms(m.nodes.k_trace, layout.head_dim, site.key_transposed,
                                               "key", notes)
    m.v_path, _, rope_v = _transforms(m.nodes.v_trace, layout.head_dim, False, "value", notes)
    if rope_v.style != "none":
        m.v_path = "other"
        notes.append("value: RoPE applied to values")
    m.nodes.key_pre_rope, m.nodes.key_states, m.nodes.key_cache = _cache_io(m.nodes.k_trace, layout.k_rows, heads["key"])
    _, m.nodes.value_states, m.nodes.value_cache = _cache_io(m.nodes.v_trace, layout.v_rows, heads["value"])
    if m.nodes.key_cache is not None:
        m.notes["kv_cache"] = op_name(m.nodes.key_cache) or m.nodes.key_cache.op

    m.q_scale, m.k_scale = m.nodes.q_trace.factor, m.nodes.k_trace.factor
    base = site.scale if site.scale is not None else 1.0 / math.sqrt(layout.head_dim)
    m.scale = base * m.q_scale * m.k_scale
    _fill_output(m, layout, facts)
    _check_rope_agrees(m, notes)
    if notes:
        raise _Unsupported("; ".join(notes))


def _check(result, what: str):
    if isinstance(result, str):
        raise _Unsupported(f"{what}: {result}")
    return result


def _decode(trace: Path, role: str, transposed: bool):
    try:
        index = trace.index_at_end()
    except _REPLAY_ERRORS as e:
        raise _Unsupported(f"{role}: cannot replay its layout ops ({e})") from None
    if transposed:
        index = index.transpose(-1, -2)
    return _check(decode_heads(index, trace.projection.out_features), role)


def _projection(p: LinearNode, rows) -> Projection:
    return Projection.from_rows(p.weight, rows, p.bias, p.transposed)


def _transforms(trace: Path, head_dim: int, transposed: bool, role: str, notes: list[str]):
    """(path kind, RoPE match, RoPE layout in head-dim coordinates) of one input's path.

    Unrecognised ops make the kind ``other`` and add a note (the match is then unsupported).
    """
    other = [s for s in trace.steps if s.kind == "other"]
    kinds = trace.kinds()
    scaled = [s for s in trace.steps if s.kind == "token_scale"]
    if scaled and role != "query":  # a query's scale is attention's; a key's is cached
        notes.append(f"{role}: scaled per token at {scaled[0].node.name}")
    kind = ("other" if other else "norm" if "norm" in kinds
            else "rope" if "rope" in kinds else "none")
    if other:
        ops = ", ".join(sorted({o for s in other for o in s.ops}))
        notes.append(f"{role}: unrecognised ops ({ops}) at {other[0].node.name}")
    ropes = [i for i, s in enumerate(trace.steps) if s.kind == "rope"]
    if len(ropes) > 1:
        raise _Unsupported(f"{role}: RoPE applied {len(ropes)} times")
    if not ropes:
        return kind, None, NO_ROPE
    step = trace.steps[ropes[0]]
    try:
        index = trace.index_at_end(ropes[0])
    except _REPLAY_ERRORS as e:
        raise _Unsupported(f"{role}: cannot replay the ops after RoPE ({e})") from None
    if transposed:
        index = index.transpose(-1, -2)
    out = shape(step.node)
    width = math.prod(out[len(out) - step.rope.ndim:])
    layout = _check(rope_layout(index, step.rope.pairs, width, head_dim), f"{role} RoPE")
    return kind, step.rope, layout


def _check_rope_agrees(m: AttentionBlock, notes: list[str]) -> None:
    if m.rope_q != m.rope_k:
        notes.append(f"query RoPE {m.rope_q} differs from key RoPE {m.rope_k}")


def _cache_io(trace: Path, rows, heads: HeadMap) -> tuple[Node | None, Node | None, Node | None]:
    """(states before RoPE, states as a cache receives them, the cache op).

    States are nodes holding exactly this input's projection ``rows``, once each, in
    ``(..., tokens, head_dim)`` head layout with as many tokens as ``heads`` has projected:
    the last such node before the RoPE step, and the first one after the last transform.
    The cache op is the first ``cache`` step.
    """
    rope = next((i for i, s in enumerate(trace.steps) if s.kind == "rope"), None)
    last = max((i for i, s in enumerate(trace.steps) if s.kind in TRANSFORMS), default=0)
    features, wanted = trace.projection.out_features, set(rows)
    pre_rope = states = None
    try:
        for i, (node, index) in enumerate(trace.indices()):
            if trace.steps[i].kind == "cache":
                return pre_rope, states, trace.steps[i].write or node
            before_rope = rope is not None and i < rope
            if (before_rope or (states is None and i >= last)) \
                    and _holds_heads_once(index, features, wanted, heads):
                if before_rope:
                    pre_rope = node
                else:
                    states = node
    except _REPLAY_ERRORS:
        pass
    return pre_rope, states, None


def _holds_heads_once(index, features: int, rows: set[int], heads: HeadMap) -> bool:
    if not isinstance(index, torch.Tensor) or index.dim() < 3:
        return False
    if tuple(index.shape[-2:]) != (heads.tokens, heads.rows.shape[1]):
        return False
    if not bool((index > 0).all()) or index.unique().numel() != index.numel():
        return False
    found = decode_heads(index, features)
    return not isinstance(found, str) and set(found.rows.flatten().tolist()) == rows


def _output_chain(attention: Node, facts: GraphFacts) -> tuple[LinearNode, list[Node]] | None:
    """The projection reading the attention output through layout ops only."""
    node, chain = attention, []
    while len(chain) < _MAX_OUTPUT_CHAIN and len(node.users) == 1:
        user = next(iter(node.users))
        proj = facts.projection(user)
        if proj is not None:
            return (proj, chain) if proj.input is node else None
        name = op_name(user)
        if (name not in LAYOUT_OPS and name not in IDENTITY_OPS) or user.args[0] is not node:
            return None
        chain.append(user)
        node = user
    return None


def _fill_output(m: AttentionBlock, layout: HeadLayout, facts: GraphFacts) -> None:
    found = _output_chain(m.nodes.attention, facts)
    if found is None:
        m.notes["o"] = "no projection reads the attention output through layout ops only"
        return
    proj, chain = found
    env = {m.nodes.attention: source_index(shape(m.nodes.attention))}
    try:
        for node in chain:
            env[node] = replay_node(node, env)
    except _REPLAY_ERRORS as e:
        m.notes["o"] = f"cannot replay the output layout ({e})"
        return
    tokens = shape(m.nodes.attention)[-2]
    error = output_columns_ok(env[chain[-1]] if chain else env[m.nodes.attention],
                              layout.q_head_of_lead, tokens, layout.head_dim)
    m.nodes.o_linear, m.nodes.attn_output = proj.node, proj.input
    if error:
        m.notes["o"] = error
        return
    m.o = Projection(proj.weight, 0, proj.out_features, proj.bias, proj.transposed)
