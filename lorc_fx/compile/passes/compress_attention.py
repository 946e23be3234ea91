"""Compress the attention of a graph that carries no latent cache (e.g. a perplexity forward).

The graph's own weights are analysed and planned; each supported attention gets
``reconstruct(project(k))`` / ``reconstruct(project(v))`` spliced in where the keys and
values leave their projections (after RoPE in ``commute`` mode, before it in
``reconstruct`` mode). The absorb pass then turns that into attention over the latent.
Attention that reads a cache of full keys is left alone: the cache's shapes belong to
Python, so only ``lorc_fx.compress(model)`` can shrink it. So is the attention of a model
``lorc_fx.compress`` prepared (its weights carry ``PLANNED``), even in a graph that shows no
latent (a prefill into an empty cache whose layers the plan keeps full): its plan says what
its cache holds. Where no layer can be compressed at all, everything is left alone with the
planner's reason, not an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch._dynamo.source import ConstantSource

from lorc_fx.analysis.attention_match import match_attention
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache.latent_ops import PROJECT, RECONSTRUCT
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import PLANNED, Plan, layer_inputs, plan_layers
from lorc_fx.plan.schedules import UnreachableFraction


@dataclass
class GraphCompression:
    plan: Plan | None = None
    compressed: list[int] = field(default_factory=list)  # attention indices in graph order
    left_alone: list[tuple[int, str]] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)  # left to lorc_fx.compress's plan


def _graph_params(gm: fx.GraphModule, example_inputs) -> dict[str, torch.Tensor]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n.name: x for n, x in zip(placeholders, example_inputs) if isinstance(x, nn.Parameter)}


def _splice(gm: fx.GraphModule, states: fx.Node, basis: torch.Tensor, rebuild: torch.Tensor,
            num_kv_heads: int, name: str) -> None:
    """Route every use of ``states`` through its rank-r reconstruction ``rebuildᵀ·basis·states``.

    The bases become buffers of ``gm``; AOT autograd asks dynamo's record of where every
    buffer came from (``gm._param_name_to_source``), so each gets a source naming it."""
    for buffer, tensor in ((name, basis), (f"{name}_rebuild", rebuild)):
        gm.register_buffer(buffer, tensor)
        if hasattr(gm, "_param_name_to_source"):
            gm._param_name_to_source[buffer] = ConstantSource(f"lorc_{buffer}")
    users = list(states.users)
    with gm.graph.inserting_after(states):
        basis_node = gm.graph.get_attr(name)
    with gm.graph.inserting_after(basis_node):
        rebuild_node = gm.graph.get_attr(f"{name}_rebuild")
    with gm.graph.inserting_after(rebuild_node):
        latent = gm.graph.call_function(PROJECT, (states, basis_node))
    with gm.graph.inserting_after(latent):
        rebuilt = gm.graph.call_function(RECONSTRUCT, (latent, rebuild_node, num_kv_heads))
    for user in users:
        user.replace_input_with(states, rebuilt)


def _planned(m: AttentionBlock, params: dict[str, torch.Tensor]) -> bool:
    """The block's key or value weights belong to a model ``lorc_fx.compress`` prepared."""
    return any(getattr(params.get(p.weight), PLANNED, False) for p in (m.k, m.v) if p)


def _why_not(m: AttentionBlock, rope_mode: str) -> str | None:
    if not m.supported:
        return m.reason
    if m.nodes.key_cache is not None or m.nodes.value_cache is not None:
        return ("reads a cache of full keys/values; call lorc_fx.compress(model) before "
                "compiling to cache latents")
    if m.nodes.key_states is None or m.nodes.value_states is None:
        return "keys/values not found as one tensor per KV head"
    if rope_mode == "reconstruct" and m.rope_k.style != "none" and m.nodes.key_pre_rope is None:
        return "keys before RoPE not located in the graph"
    return None


def compress_attention(gm: fx.GraphModule, example_inputs, options: PlanOptions) -> GraphCompression:
    params = _graph_params(gm, example_inputs)
    matches = match_attention(gm, {name: name for name in params})
    result = GraphCompression()
    usable = []
    for m in matches:
        if _planned(m, params):
            result.planned.append(m.layer)
        elif (why := _why_not(m, options.rope)) is None:
            usable.append(m)
        else:
            result.left_alone.append((m.layer, why))
    if not usable:
        return result
    try:
        result.plan = plan_layers(layer_inputs(params, usable), options)
    except UnreachableFraction as err:
        if err.lowest < 1.0:
            raise  # some layers compress, not as far as asked: the user's to change
        result.left_alone += [(m.layer, f"nothing here compresses ({err})") for m in usable]
        return result
    by_layer = {l.layer: l for l in result.plan.layers}
    for m in usable:
        layer, nodes, i = by_layer[m.layer], m.nodes, m.layer
        if layer.skipped:
            continue
        dtype = nodes.key_states.meta["example_value"].dtype
        keys = nodes.key_pre_rope if layer.k_latent_of == "pre_rope" else nodes.key_states
        if layer.k_compressible:
            _splice(gm, keys, layer.k_basis.to(dtype), layer.k_rebuild.to(dtype), m.num_kv_heads,
                    f"_lorc_k_basis_{i}")
        if layer.v_compressible:
            _splice(gm, nodes.value_states, layer.v_basis.to(dtype), layer.v_rebuild.to(dtype),
                    m.num_kv_heads, f"_lorc_v_basis_{i}")
        result.compressed.append(i)
    gm.graph.lint()
    gm.recompile()
    return result
