"""Input metrics that pick a layer's basis.

Every basis is the spectrum of ``W·S`` with ``S Sᵀ = G``, ``G`` the second moment of the
projection input under some assumption; a basis provider returns ``G`` per layer index
(no entry: the identity, i.e. the paper's weight-only SVD).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .blocks import AttentionBlock

InputMetric = Callable[[nn.Module, list[AttentionBlock]], dict[int, torch.Tensor]]


def weight_only(model: nn.Module, blocks: list[AttentionBlock]) -> dict[int, torch.Tensor]:
    """The paper: SVD of the weight itself (inputs assumed isotropic)."""
    return {}


BASES: dict[str, InputMetric] = {"weight": weight_only}
