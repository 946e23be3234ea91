"""Find every attention block of a model from its dynamo graphs (no per-family code)."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .attention_match import match_attention
from .capture import capture
from .records import AttentionBlock, named_params
from .sharding import block_sharding


def analyze(model: nn.Module, example_inputs=None) -> list[AttentionBlock]:
    """Attention blocks in execution order; ``layer`` counts them from 0.

    ``example_inputs``: as for ``lorc_fx.analysis.capture.capture`` (default: synthetic token ids).
    """
    captured = capture(model, example_inputs)
    params = named_params(model)
    blocks: list[AttentionBlock] = []
    for call in captured.calls:
        for match in match_attention(captured.graphs[call.graph].gm, call.param_names):
            notes = dict(match.notes, graph=call.graph, attention_node=match.nodes.attention.name)
            blocks.append(_with_sharding(replace(match, layer=len(blocks), notes=notes,
                                                 nodes=None), params))
    return blocks


def _with_sharding(block: AttentionBlock, params) -> AttentionBlock:
    """The block with its tensor-parallel split, or unsupported where it cannot be followed."""
    if not block.supported:
        return block
    split = block_sharding((params[block.k.weight], block.k.transposed),
                           (params[block.v.weight], block.v.transposed))
    if isinstance(split, str):
        return replace(block, supported=False, reason=f"tensor parallel: {split}")
    return replace(block, sharding=split)
