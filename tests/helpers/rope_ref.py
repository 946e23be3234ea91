"""A from-scratch RoPE used as ground truth by the tests (rotate-half or interleaved)."""
import torch

from lorc_fx.analysis.records import RopeLayout


def rotate(keys: torch.Tensor, positions: torch.Tensor, rope: RopeLayout,
           base: float = 10000.0) -> torch.Tensor:
    """Rotate ``keys`` (..., head_dim) at ``positions`` (broadcastable to ``keys[..., 0]``)."""
    out = keys.clone()
    for t, (a, b) in enumerate(rope.pairs()):
        theta = positions * base ** (-2 * t / rope.rotary_dim)
        cos, sin = torch.cos(theta), torch.sin(theta)
        out[..., a] = keys[..., a] * cos - keys[..., b] * sin
        out[..., b] = keys[..., b] * cos + keys[..., a] * sin
    return out
