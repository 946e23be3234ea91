"""Find attention ops in a graph: ``scaled_dot_product_attention`` or manual
``softmax(q @ k^T * scale + mask) @ v``.

Manual scores may also be softcapped (Gemma 2: ``cap · tanh(s / cap)``) and joined by sink
logits (gpt-oss: a per-head logit concatenated after the keys' scores before the softmax,
its probability dropped before ``· v``), with the row maximum subtracted first. Both act
on the scores alone, after ``q · k`` and before ``· v``: whatever stores the keys and values,
attention over them is the model's. Anything else on the scores is reported, not matched.
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
    softcap: float | None = None  # scores are cap · tanh(q·k · scale / cap)
    sinks: int = 0             # logits joined after the keys' scores, dropped after softmax


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
    probs, dropped = softmax, 0  # casts, dropout, (Bloom) a view merging batch and heads,
    while len(probs.users) == 1:  # and the sinks' columns cut off
        user = next(iter(probs.users))
        cut = _columns_dropped(user, probs)
        if not (cut or _passes_through(user, probs)):
            break
        probs, dropped = user, dropped + cut
    pv = next((u for u in probs.users if is_matmul(u) and u.args[0] is probs), None)
    if pv is None:
        return None
    scores, factor, error, softcap, sinks = _walk_scores(softmax.args[0], facts)
    if not error and sinks != dropped:
        error = (f"attention probabilities lose {dropped} columns after the softmax, but "
                 f"{sinks} sink logits join the scores")
    if error:
        return AttentionSite(pv, "manual", None, None, pv.args[1], True, None, error)
    if op_name(scores) == "baddbmm":
        q, kt = arg(scores, 1, "batch1"), arg(scores, 2, "batch2")
    else:
        q, kt = scores.args[0], scores.args[1]
    return AttentionSite(pv, "manual", q, kt, pv.args[1], True, factor, softcap=softcap,
                         sinks=sinks)


def _passes_through(node: Node, source: Node) -> bool:
    name = op_name(node)
    return (name in IDENTITY_OPS or name in ("view", "reshape")) and node.args[0] is source


def _columns_dropped(node: Node, source: Node) -> int:
    """``n`` where ``node`` is ``source[..., :-n]`` (the sinks' probabilities dropped), else 0."""
    if op_name(node) != "getitem" or node.args[0] is not source:
        return 0
    index = node.args[1]
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis
            and isinstance(index[1], slice)):
        return 0
    cut = index[1]
    ok = cut.start is None and cut.step is None and isinstance(cut.stop, int) and cut.stop < 0
    return -cut.stop if ok else 0


def _row_max(node, of: Node) -> bool:
    """Whether ``node`` is the maximum of ``of`` over its last dim (``max(...).values`` or
    ``amax``), kept as a dim: subtracting it leaves the softmax unchanged."""
    if op_name(node) == "getitem" and node.args[1] == 0:
        node = node.args[0]
        if op_name(node) != "max":
            return False
    elif op_name(node) != "amax":
        return False
    rank = len(shape(of) or ())
    return node.args[0] is of and arg(node, 1, "dim") in (-1, rank - 1, [-1], [rank - 1]) \
        and bool(arg(node, 2, "keepdim", False))


def _sink_columns(node: Node, facts) -> tuple[Node, int] | None:
    """``(scores, n)`` where ``node`` is ``cat([scores, sinks], dim=-1)`` with sinks of ``n``
    columns that do not depend on the activations (learned logits, one per head)."""
    if op_name(node) != "cat":
        return None
    parts, dim = node.args[0], arg(node, 1, "dim", 0)
    rank = len(shape(node) or ())
    if dim not in (-1, rank - 1) or len(parts) < 2 or not all(isinstance(p, Node) for p in parts):
        return None
    if not facts.is_derived(parts[0]) or any(facts.is_derived(p) for p in parts[1:]):
        return None
    return parts[0], sum((shape(p) or (0,))[-1] for p in parts[1:])


def _walk_scores(node, facts) -> tuple[Node | None, float, str, float | None, int]:
    """Back from the softmax input through scaling, masking, a floor, a softcap, a row
    maximum subtracted and sink logits joined to ``q @ k^T``: (that node, the scale, an error, the
    softcap, the sinks' count)."""
    factor, softcap, sinks = 1.0, None, 0
    for _ in range(32):
        name = op_name(node)
        derived = facts.derived_inputs(node) if isinstance(node, Node) else []
        if is_matmul(node):
            return node, factor * (softcap or 1.0), "", softcap, sinks
        if name == "baddbmm":
            alpha = scalar_constant(node.kwargs.get("alpha", 1.0))
            if alpha is None:
                break
            return node, factor * alpha * (softcap or 1.0), "", softcap, sinks
        if name == "tanh" and softcap is None and factor > 0:
            softcap, factor = factor, 1.0  # cap · tanh(s · factor_below): the factor above is the cap
            node = node.args[0]
        elif name == "sub" and _row_max(node.args[1], node.args[0]):
            node = node.args[0]
        elif name == "cat" and not sinks and (joined := _sink_columns(node, facts)):
            node, sinks = joined
        elif name in IDENTITY_OPS or name in ("view", "reshape"):
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
        elif name in ("max", "maximum") and len(derived) == 1 and len(node.args) == 2 \
                and not isinstance(node.args[1], int):
            node = derived[0]  # a floor under the scores (XGLM's finfo.min), elementwise
        else:
            break
    where = node.name if isinstance(node, Node) else repr(node)
    return None, factor, f"attention scores pass through {where} ({op_name(node)})", softcap, sinks
