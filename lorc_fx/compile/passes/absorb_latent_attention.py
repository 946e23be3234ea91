"""Rewrite SDPA over reconstructed latents into attention over the latents themselves.

Patterns (as the latent cache traces)::

    k = lorc.reconstruct(c_k, P_k, h_kv)                         # keys cached after RoPE
    k = lorc.rotated_reconstruct(c_k, P_k, h_kv, cos, sin, style)  # keys cached before it
    v = lorc.reconstruct(c_v, P_v, h_kv)
    out = sdpa(q, repeat_kv?(k), repeat_kv?(v), mask, ...)

With post-RoPE keys the SDPA becomes ``latent_attention`` (the query goes through the
per-head blocks of ``P_k``, attention runs once over the shared latent, the output comes back
through ``P_v``). With pre-RoPE keys, in a graph of at most ``MAX_DECODE_QUERY`` query tokens
(decode steps, draft verification), it becomes ``rotary_latent_attention``: keys rebuilt
and scored against queries turned back by each key's angle, values absorbed. Both exact; neither builds a ``(b, h, n, d)`` repeat of the
heads. Prefill over pre-RoPE keys keeps SDPA over the rebuilt keys and values (the fused
attention, and scores never materialised), and the ops are lowered to maths.
"""
from __future__ import annotations

from torch import fx

from lorc_fx.compile.latent_attention import latent_attention, rotary_latent_attention
from lorc_fx.cache.latent_ops import RECONSTRUCT, ROTATED_RECONSTRUCT
from .graph_utils import SDPA_TARGETS, erase_if_unused, fake, strip_repeat_kv

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_RECONSTRUCT_ARGS = ("latent", "basis", "num_heads")
_ROTATED_ARGS = ("latent", "basis", "num_heads", "cos", "sin", "style")
# query tokens up to which attention over pre-RoPE keys materialises its scores
MAX_DECODE_QUERY = 32


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict:
    """A call's arguments by name, whether given by position or by keyword."""
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _is_decode(sdpa: dict) -> bool:
    """A static query length of at most ``MAX_DECODE_QUERY``, no dropout, no causal flag."""
    query = fake(sdpa["query"])
    t = None if query is None else query.shape[2]
    return (isinstance(t, int) and t <= MAX_DECODE_QUERY and not sdpa.get("dropout_p")
            and not sdpa.get("is_causal"))


def _absorbed_call(sdpa: dict, k_src: fx.Node, v_src: fx.Node):
    """The absorbed attention call replacing ``sdpa`` as ``(function, args, kwargs)``, or None
    when its keys and values are not latents it can read."""
    if v_src.target is not RECONSTRUCT:
        return None
    v = _bound(v_src, _RECONSTRUCT_ARGS)
    mask, scale = sdpa.get("attn_mask"), sdpa.get("scale")
    if k_src.target is RECONSTRUCT:
        k = _bound(k_src, _RECONSTRUCT_ARGS)
        return latent_attention, (
            sdpa["query"], k["latent"], v["latent"], k["basis"], v["basis"], k["num_heads"]), dict(
            attn_mask=mask, dropout_p=sdpa.get("dropout_p", 0.0),
            is_causal=sdpa.get("is_causal", False), scale=scale)
    if k_src.target is ROTATED_RECONSTRUCT and _is_decode(sdpa):
        k = _bound(k_src, _ROTATED_ARGS)
        return rotary_latent_attention, (
            sdpa["query"], k["latent"], k["cos"], k["sin"], v["latent"], k["basis"], v["basis"],
            k["num_heads"], k["style"]), dict(attn_mask=mask, scale=scale)
    return None


def absorb_latent_attention(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA whose keys and values are latent reconstructions it can read;
    returns the count."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        a = _bound(node, _SDPA_ARGS)
        call = _absorbed_call(a, strip_repeat_kv(a["key"]), strip_repeat_kv(a["value"]))
        if call is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(*call)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        stale = [a["key"], a["value"]]
        graph.erase_node(node)
        erase_if_unused(graph, stale)
        rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
