"""Turn attention-block records into the plan's per-layer inputs."""
from __future__ import annotations

import torch

from .blocks import AttentionBlock
from .plan import LayerInput


def _checked_weight(block: AttentionBlock, role: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
    projection = getattr(block, role)
    weight = projection.weight_tensor(params).detach()
    if not weight.is_floating_point():
        raise ValueError(f"layer {block.layer}: {role.upper()} projection weight "
                         f"{projection.weight!r} has dtype {weight.dtype}; LoRC needs floating-point "
                         "weights (dequantize the model first)")
    if weight.device.type == "meta":
        raise ValueError(f"layer {block.layer}: {role.upper()} projection weight "
                         f"{projection.weight!r} is on the meta device; load the weights first")
    return weight


def layer_inputs(params: dict[str, torch.Tensor], blocks: list[AttentionBlock]) -> list[LayerInput]:
    """One :class:`LayerInput` per supported block (``params``: name → tensor, as the
    blocks' projections name them); unsupported blocks are not planned."""
    inputs = []
    for block in blocks:
        if not block.supported:
            continue
        keys_linear = block.k_path in ("none", "rope")
        inputs.append(LayerInput(
            layer=block.layer,
            k_weight=_checked_weight(block, "k", params),
            v_weight=_checked_weight(block, "v", params),
            num_heads=block.num_heads, num_kv_heads=block.num_kv_heads,
            head_dim=block.head_dim, rope=block.rope_k,
            compress_k=keys_linear, compress_v=block.v_path == "none",
            note="" if keys_linear else f"keys kept full: {block.k_path} between projection and cache",
        ))
    return inputs
