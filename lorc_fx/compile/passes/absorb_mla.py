"""Rewrite attention over MLA's per-step expansion of its cached latent
(``analysis.mla_match``) into ``compile.mla_attention``: attention over the latent, the
up-projection folded into query and output (SDPA, or manual attention's two products).
Exact; whatever the latent is (the cache's floats, a quantized side's ``lorc::dequantize``)
stays as it is, for lowering."""
from __future__ import annotations

from torch import fx

from lorc_fx.analysis.fx_ops import arg
from lorc_fx.analysis.mla_match import match_manual_mla, match_mla
from lorc_fx.compile.mla_attention import mla_attention, mla_scores, mla_sums
from .absorb_latent_attention import few_query_tokens
from .graph_utils import SDPA_TARGETS, erase_if_unused, replace_call


def absorb_mla(gm: fx.GraphModule) -> int:
    """Rewrite every attention over MLA's expanded latent (SDPA, or manual attention's two
    products); returns the count."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        match = match_mla(node)
        if match is None:
            continue
        # decode steps read the heads as query rows, their mask expanded per head
        replace_call(graph, node, mla_attention,
                     (match.query, match.latent, match.rope_key, match.weight, match.nope_dim),
                     dict(attn_mask=arg(node, 3, "attn_mask"),
                          is_causal=arg(node, 5, "is_causal", False),
                          scale=arg(node, 6, "scale"),
                          heads_as_rows=few_query_tokens(match.query)))
        erase_if_unused(graph, match.expansion)
        rewritten += 1
    for node in list(graph.nodes):
        found = match_manual_mla(node) if node.op == "call_function" else None
        if found is None:
            continue
        match, scores = found
        replace_call(graph, scores, mla_scores,
                     (match.query, match.latent, match.rope_key, match.weight, match.nope_dim))
        replace_call(graph, node, mla_sums,
                     (node.args[0], match.latent, match.weight, match.nope_dim))
        erase_if_unused(graph, match.expansion)
        rewritten += 1
    graph.lint()
    gm.recompile()
    return rewritten

