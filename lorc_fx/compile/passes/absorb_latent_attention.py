"""Rewrite SDPA over reconstructed latents into attention over the latents themselves.

Pattern (as the latent cache traces)::

    k = lorc.reconstruct(c_k, P_k, h_kv); v = lorc.reconstruct(c_v, P_v, h_kv)
    out = sdpa(q, repeat_kv?(k), repeat_kv?(v), mask, ...)

becomes ``latent_attention(q, c_k, c_v, P_k, P_v, h_kv, mask, ...)`` (lorc_fx.absorbed):
the query goes through the per-head blocks of ``P_k``, attention runs once over the shared
latent, and the output comes back through ``P_v``. Exact; no ``(b, h_kv, n, d)`` tensor is
ever rebuilt.
"""
from __future__ import annotations

from torch import fx

from lorc_fx.compile.latent_attention import latent_attention
from lorc_fx.cache.latent_ops import RECONSTRUCT
from .graph_utils import SDPA_TARGETS, erase_if_unused, strip_repeat_kv

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_RECONSTRUCT_ARGS = ("latent", "basis", "num_heads")


def _bound(node: fx.Node, names: tuple[str, ...]) -> dict:
    """A call's arguments by name, whether given by position or by keyword."""
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def absorb_latent_attention(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA whose keys and values are latent reconstructions; returns the count."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        a = _bound(node, _SDPA_ARGS)
        k_src, v_src = strip_repeat_kv(a["key"]), strip_repeat_kv(a["value"])
        if not (k_src.target is RECONSTRUCT and v_src.target is RECONSTRUCT):
            continue
        k, v = _bound(k_src, _RECONSTRUCT_ARGS), _bound(v_src, _RECONSTRUCT_ARGS)
        with graph.inserting_before(node):
            new = graph.call_function(latent_attention, (
                a["query"], k["latent"], v["latent"], k["basis"], v["basis"],
                k["num_heads"]), dict(
                attn_mask=a.get("attn_mask"), dropout_p=a.get("dropout_p", 0.0),
                is_causal=a.get("is_causal", False), scale=a.get("scale")))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        stale = [a["key"], a["value"]]
        graph.erase_node(node)
        erase_if_unused(graph, stale)
        rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
