"""Find every attention block of a model from its dynamo graphs (no per-family code)."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from .attention_match import match_attention
from .cache_probe import probe_cache
from .capture import capture
from .records import AttentionBlock, attention_path, named_params
from .sharding import block_sharding


def analyze(model: nn.Module, example_inputs=None) -> list[AttentionBlock]:
    """Attention blocks in execution order; ``layer`` is the index of the cache layer each
    writes (its module's ``layer_idx``, which a hybrid model's other layers also take: see
    :func:`cache_layers`), else counts them from 0.

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
    return cache_layers(model, blocks)


def cache_layers(model: nn.Module, blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """``blocks`` numbered by the cache layer each writes: the ``layer_idx`` of the nearest
    module above its projections that has one (transformers' attention modules pass it to
    ``Cache.update``). In a hybrid model (attention beside Mamba or convolution layers) the
    attention blocks are not the cache's first layers. Where a block has none, or two blocks
    share one (one attention module called at several layers, as Zamba's), the cache layers
    that hold keys and values after one forward (``cache_probe``) number them in execution
    order, if there are as many; else they keep their execution order."""
    found = [_layer_idx(model, b) for b in blocks]
    if None in found or len(set(found)) != len(found) or found != sorted(found):
        probe = probe_cache(model) if blocks else None
        found = [c.layer for c in probe.layers] if probe is not None else []
        if len(found) != len(blocks):
            return blocks
    return [replace(b, layer=i) for b, i in zip(blocks, found)]


def _layer_idx(model: nn.Module, block: AttentionBlock) -> int | None:
    if not any((block.q, block.k, block.v, block.o)):
        return None
    path = attention_path(block)
    while True:
        index = getattr(model.get_submodule(".".join(path)), "layer_idx", None)
        if isinstance(index, int):
            return index if index >= 0 else None  # Zamba2's shared block: -1
        if not path:
            return None
        path.pop()


def _with_sharding(block: AttentionBlock, params) -> AttentionBlock:
    """The block with its tensor-parallel split, or unsupported where it cannot be followed."""
    if not block.supported:
        return block
    split = block_sharding((params[block.k.weight], block.k.transposed),
                           (params[block.v.weight], block.v.transposed))
    if isinstance(split, str):
        return replace(block, supported=False, reason=f"tensor parallel: {split}")
    return replace(block, sharding=split)
