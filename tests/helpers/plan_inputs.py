"""Random plan inputs shared by the plan and allocation tests."""
import torch

from lorc_fx.analysis.records import RopeLayout
from lorc_fx.plan.planner import LayerInput


def random_layers(seed: int, n_layers: int = 4, kv_heads: int = 2, head_dim: int = 8,
                  hidden: int = 32, rope: RopeLayout = RopeLayout("half", 8)) -> list[LayerInput]:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(n_layers):
        # a per-layer spread of singular values, so condition numbers differ by layer
        scale = torch.logspace(0, 1 + i % 3, hidden, dtype=torch.float64)
        mix = lambda: torch.randn(kv_heads * head_dim, hidden, generator=gen, dtype=torch.float64) * scale
        layers.append(LayerInput(i, mix(), mix(), kv_heads * 2, kv_heads, head_dim, rope))
    return layers
