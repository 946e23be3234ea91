"""Capture a model's dynamo graphs, and which parameter every placeholder holds.

The capturing backend records each graph with its example inputs and wraps it so every
*call* is logged too: when a graph is reused (a graph break inside a decoder layer gives one
graph run once per layer), each call carries its own parameters, so layers come out in
execution order with the right weights.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import GraphModule

DEFAULT_SEQ_LEN = 7


@dataclass
class CapturedGraph:
    gm: GraphModule
    example_inputs: list
    param_names: dict[str, str]   # placeholder node name -> model parameter name


@dataclass
class GraphCall:
    graph: int                    # index into Capture.graphs
    param_names: dict[str, str]   # this call's placeholder -> parameter names


@dataclass
class Capture:
    graphs: list[CapturedGraph]
    calls: list[GraphCall]        # in execution order


def parameter_ids(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``; a tied parameter keeps its first name."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def placeholder_param_names(gm: GraphModule, inputs, ids: dict[int, str]) -> dict[str, str]:
    """Map the placeholders of ``gm`` fed with model parameters to the parameters' names.

    ``inputs`` are the tensors the graph receives (a backend's ``example_inputs``), in
    placeholder order; ``ids`` comes from ``parameter_ids(model)``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n.name: ids[id(x)] for n, x in zip(placeholders, inputs) if id(x) in ids}


def capture(model: nn.Module, example_inputs=None, **forward_kwargs) -> Capture:
    """Run ``model`` once under ``torch.compile`` with a recording backend.

    ``example_inputs``: a tensor or tuple (positional) or dict (keyword); by default a short
    synthetic ``input_ids``. ``use_cache=False`` is passed when ``forward`` accepts it and
    the caller did not set it. Dynamo's caches are reset before and after.
    """
    args, kwargs = _forward_inputs(model, example_inputs, forward_kwargs)
    ids = parameter_ids(model)
    graphs: list[CapturedGraph] = []
    calls: list[GraphCall] = []

    def backend(gm: GraphModule, inputs):
        index = len(graphs)
        graphs.append(CapturedGraph(gm, list(inputs), placeholder_param_names(gm, inputs, ids)))

        def run(*call_inputs):
            calls.append(GraphCall(index, placeholder_param_names(gm, call_inputs, ids)))
            return gm.forward(*call_inputs)

        return run

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=False, dynamic=False)
        with torch.no_grad():
            compiled(*args, **kwargs)
    except torch._dynamo.exc.TorchRuntimeError as err:
        cause = re.search(r": got (.*)", str(err))  # the op's own error, in its explanation
        raise NotTraceable(f"dynamo cannot trace {type(model).__name__}: "
                           f"{cause.group(1) if cause else str(err).strip().splitlines()[0]}"
                           ) from err
    finally:
        torch._dynamo.reset()
    return Capture(graphs, calls)


def _forward_inputs(model: nn.Module, example_inputs, forward_kwargs) -> tuple[tuple, dict]:
    kwargs = dict(forward_kwargs)
    if example_inputs is None:
        args = (synthetic_input_ids(model),)
    elif isinstance(example_inputs, dict):
        args, kwargs = (), {**example_inputs, **kwargs}
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        args = (example_inputs,)
    if "use_cache" not in kwargs and "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False
    return args, kwargs


class NotTraceable(ValueError):
    """Dynamo fails on the model's forward (a fake-tensor run the eager forward survives:
    seen on configs whose shapes only eager broadcasting reconciles)."""


class NoTokenInputs(ValueError):
    """The model takes no token ids the analysis could make up: pass example inputs."""


def synthetic_input_ids(model: nn.Module, seq_len: int = DEFAULT_SEQ_LEN) -> torch.Tensor:
    """``(1, seq_len)`` token ids within the model's vocabulary."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        vocab = next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
                     None)
    if vocab is None:
        raise NoTokenInputs(f"cannot make token ids for {type(model).__name__}: it has no "
                            "config.vocab_size and no nn.Embedding, so it is not a language "
                            "model the analysis can trace by itself; to trace it with your "
                            "inputs, pass blocks=lorc_fx.analyze(model, example_inputs)")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = (torch.arange(seq_len) * 7 + 3) % vocab
    return ids.unsqueeze(0).to(device)
