"""Find every attention block of a model from its dynamo graphs (no per-family code)."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .attention_match import match_attention
from .capture import capture
from .records import AttentionBlock


def analyze(model: nn.Module, example_inputs=None) -> list[AttentionBlock]:
    """Attention blocks in execution order; ``layer`` counts them from 0.

    ``example_inputs``: as for ``lorc_fx.analysis.capture.capture`` (default: synthetic token ids).
    """
    captured = capture(model, example_inputs)
    blocks: list[AttentionBlock] = []
    for call in captured.calls:
        for match in match_attention(captured.graphs[call.graph].gm, call.param_names):
            notes = dict(match.notes, graph=call.graph, attention_node=match.nodes.attention.name)
            blocks.append(replace(match, layer=len(blocks), notes=notes, nodes=None))
    return blocks
