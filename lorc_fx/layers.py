"""Turn attention-block records into the plan's per-layer inputs."""
from __future__ import annotations

from torch import nn

from .blocks import AttentionBlock, named_params
from .plan import LayerInput


def layer_inputs(model: nn.Module, blocks: list[AttentionBlock]) -> list[LayerInput]:
    """One :class:`LayerInput` per supported block; unsupported blocks are not planned."""
    params = named_params(model)
    inputs = []
    for block in blocks:
        if not block.supported:
            continue
        keys_linear = block.k_path in ("none", "rope")
        inputs.append(LayerInput(
            layer=block.layer,
            k_weight=block.k.weight_tensor(params).detach(),
            v_weight=block.v.weight_tensor(params).detach(),
            num_heads=block.num_heads, num_kv_heads=block.num_kv_heads,
            head_dim=block.head_dim, rope=block.rope_k,
            compress_k=keys_linear, compress_v=block.v_path == "none",
            note="" if keys_linear else f"keys kept full: {block.k_path} between projection and cache",
        ))
    return inputs
