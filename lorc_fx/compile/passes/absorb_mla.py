"""Rewrite attention over MLA's per-step expansion of its cached latent
(``analysis.mla_match``) into ``compile.mla_attention``: attention over the latent, the
up-projection folded into query and output. Exact; whatever the latent is (the cache's floats,
a quantized side's ``lorc::dequantize``) stays as it is, for lowering."""
from __future__ import annotations

from torch import fx

from lorc_fx.analysis.fx_ops import arg
from lorc_fx.analysis.mla_match import match_mla
from lorc_fx.compile.mla_attention import mla_attention
from .absorb_latent_attention import MAX_DECODE_QUERY
from .graph_utils import SDPA_TARGETS, erase_if_unused, fake


def _few_query_tokens(query: fx.Node) -> bool:
    """A static query length of at most ``MAX_DECODE_QUERY`` (decode steps, draft
    verification): the heads are read as query rows, their mask expanded per head."""
    t = fake(query).shape[2]
    return isinstance(t, int) and t <= MAX_DECODE_QUERY


def absorb_mla(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA over MLA's expanded latent; returns the count."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        match = match_mla(node)
        if match is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(
                mla_attention,
                (match.query, match.latent, match.rope_key, match.weight, match.nope_dim),
                dict(attn_mask=arg(node, 3, "attn_mask"),
                     is_causal=arg(node, 5, "is_causal", False), scale=arg(node, 6, "scale"),
                     heads_as_rows=_few_query_tokens(match.query)))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        erase_if_unused(graph, match.expansion)
        rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten
