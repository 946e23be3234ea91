"""Find attention ops in a graph: ``scaled_dot_product_attention`` or manual
``softmax(q @ k^T * scale + mask) @ v``.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from .fx_ops import IDENTITY_OPS, arg, is_matmul, op_name, scalar_constant, shape


@dataclass(frozen=True)
class AttentionSite:
    node: Node                 # the attention output (SDPA node, or the probs @ v matmul)
    op: str                    # sdpa | sdpa_gqa | manual
    query: Node | None
    key: Node | None           # as the attention reads it (k^T for manual attention)
    value: Node | None
    key_transposed: bool
    scale: float | None        # score scale given at the op; None: SDPA default 1/sqrt(d)
    error: str = ""            # set when this is attention whose scores could not be read


def find_sites(facts) -> list[AttentionSite]:
    sites = []
    for node in facts.graph.nodes:
        name = op_name(node)
        if name == "scaled_dot_product_attention":
            sites.append(_sdpa_site(node))
        elif name == "softmax" and facts.is_derived(node):
            site = _manual_site(node, facts)
            if site is not None:
                sites.append(site)
    return sites


def _sdpa_site(node: Node) -> AttentionSite:
    gqa = bool(arg(node, 7, "enable_gqa", False))
    scale = arg(node, 6, "scale")
    value = scalar_constant(scale) if scale is not None else None
    error = "" if scale is None or value is not None else "the SDPA scale is not a constant"
    return AttentionSite(node, "sdpa_gqa" if gqa else "sdpa", arg(node, 0, "query"),
                         arg(node, 1, "key"), arg(node, 2, "value"), False, value, error)


def _manual_site(softmax: Node, facts) -> AttentionSite | None:
    """``softmax`` over the last dim whose probabilities multiply values: walk its scores back."""
    rank = len(shape(softmax) or ())
    if arg(softmax, 1, "dim") not in (-1, rank - 1):
        return None
    probs = softmax  # casts, dropout, and (Bloom) a view merging batch and heads
    while len(probs.users) == 1 and _passes_through(next(iter(probs.users)), probs):
        probs = next(iter(probs.users))
    pv = next((u for u in probs.users if is_matmul(u) and u.args[0] is probs), None)
    if pv is None:
        return None
    scores, factor, error = _walk_scores(softmax.args[0], facts)
    if error:
        return AttentionSite(pv, "manual", None, None, pv.args[1], True, None, error)
    if op_name(scores) == "baddbmm":
        q, kt = arg(scores, 1, "batch1"), arg(scores, 2, "batch2")
    else:
        q, kt = scores.args[0], scores.args[1]
    return AttentionSite(pv, "manual", q, kt, pv.args[1], True, factor)


def _passes_through(node: Node, source: Node) -> bool:
    name = op_name(node)
    return (name in IDENTITY_OPS or name in ("view", "reshape")) and node.args[0] is source


def _walk_scores(node, facts) -> tuple[Node | None, float, str]:
    """Back from the softmax input through scaling and masking to ``q @ k^T``."""
    factor = 1.0
    for _ in range(32):
        name = op_name(node)
        derived = facts.derived_inputs(node) if isinstance(node, Node) else []
        if is_matmul(node):
            return node, factor, ""
        if name == "baddbmm":
            alpha = scalar_constant(node.kwargs.get("alpha", 1.0))
            if alpha is None:
                break
            return node, factor * alpha, ""
        if name in IDENTITY_OPS or name in ("view", "reshape"):
            node = node.args[0]
        elif name in ("mul", "div") and len(derived) == 1 and len(node.args) == 2:
            other = node.args[1] if node.args[0] is derived[0] else node.args[0]
            c = scalar_constant(other)
            if c is None or (name == "div" and (node.args[0] is not derived[0] or c == 0)):
                break
            factor *= c if name == "mul" else 1.0 / c
            node = derived[0]
        elif name in ("add", "sub", "masked_fill", "where") and len(derived) == 1:
            if name == "sub" and node.args[0] is not derived[0]:
                break
            node = derived[0]  # masks and position biases do not touch q or k
        else:
            break
    where = node.name if isinstance(node, Node) else repr(node)
    return None, factor, f"attention scores pass through {where} ({op_name(node)})"
