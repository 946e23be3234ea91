"""A calibration-free input metric: the scale a normalisation applies to the K/V input.

Pre-norm transformers feed K/V projections ``γ ⊙ x̂`` (+ ``β``), with ``x̂`` normalised per
token. Assuming ``x̂`` isotropic with unit variance per channel, ``E[x xᵀ] = diag(γ²) + ββᵀ``.
Which parameter is ``γ`` comes from data flow in the captured graph: the 1-D parameter that
multiplies the K projection's input (or a ``layer_norm``'s weight), never from module names.
"""
from __future__ import annotations

import torch
from torch import nn

from lorc_fx.analysis.capture import capture
from lorc_fx.analysis.fx_ops import arg, op_name, shape, strip_identity
from lorc_fx.analysis.projections import as_projection, param_name

from lorc_fx.analysis.records import AttentionBlock, named_params


def _scale_of(node, names: dict[str, str], width: int) -> tuple[str | None, str | None]:
    """(γ, β) parameter names of the op producing a projection's input, if it is a scale."""
    node = strip_identity(node)
    op = op_name(node)
    if op == "add":
        for inner, other in (node.args[:2], node.args[1::-1]):
            bias = param_name(other, names)
            if bias is not None and shape(other) == (width,):
                gamma, _ = _scale_of(inner, names, width)
                if gamma is not None:
                    return gamma, bias
    if op == "mul":
        for operand in node.args[:2]:
            name = param_name(operand, names)
            if name is not None and shape(operand) == (width,):
                return name, None
    if op == "layer_norm":
        gamma, beta = arg(node, 2, "weight"), arg(node, 3, "bias")
        return param_name(gamma, names), param_name(beta, names) if beta is not None else None
    return None, None


def norm_grams(model: nn.Module, blocks: list[AttentionBlock]) -> dict[int, torch.Tensor]:
    """Layer -> ``diag(γ²) + ββᵀ`` for every layer whose K input is a normalisation's output."""
    wanted = {b.k.weight: b.layer for b in blocks if b.supported}
    params = named_params(model)
    found: dict[int, torch.Tensor] = {}
    captured = capture(model)
    for call in captured.calls:
        for node in captured.graphs[call.graph].gm.graph.nodes:
            proj = as_projection(node, call.param_names)
            if proj is None or proj.weight not in wanted:
                continue
            width = params[proj.weight].shape[0 if proj.transposed else 1]
            gamma, beta = _scale_of(proj.input, call.param_names, width)
            if gamma is None:
                continue
            g = params[gamma].detach().cpu().to(torch.float64)
            gram = torch.diag(g.square())
            if beta is not None:
                b = params[beta].detach().cpu().to(torch.float64)
                gram = gram + torch.outer(b, b)
            found[wanted[proj.weight]] = gram
    return found
