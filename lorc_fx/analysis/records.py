"""What the graph analysis knows about one attention block: the record the analysis hands
the plan and the graph rewrite.

These records are the only thing the rank plan, the latent cache and the graph rewrite read
about a model's attention: no module class names, no per-family code.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from itertools import takewhile
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from .sharding import Sharding, local_tensor


@dataclass(frozen=True)
class Projection:
    """Rows ``[start, stop)`` of a weight in nn.Linear layout ``(out, in)``.

    ``transposed`` marks weights stored ``(in, out)`` (GPT-2 ``Conv1D`` / ``addmm``): the row
    range then indexes the weight's columns.

    ``rows``, when set, lists the rows explicitly, in (head, dim) order, for projections whose
    rows are not one contiguous block (GPT-NeoX's fused ``query_key_value`` interleaves q, k and
    v per head). ``start``/``stop`` then bound the rows (``min``, ``max + 1``); use ``width`` and
    ``row_index()`` rather than ``stop - start``.
    """

    weight: str
    start: int
    stop: int
    bias: str | None = None
    transposed: bool = False
    rows: tuple[int, ...] | None = None

    @classmethod
    def from_rows(cls, weight: str, rows, bias: str | None = None,
                  transposed: bool = False) -> "Projection":
        """The compact ``[start, stop)`` form when ``rows`` is contiguous, else explicit rows."""
        rows = tuple(int(r) for r in rows)
        start, stop = min(rows), max(rows) + 1
        contiguous = rows == tuple(range(start, stop))
        return cls(weight, start, stop, bias, transposed, None if contiguous else rows)

    @property
    def width(self) -> int:
        return len(self.rows) if self.rows is not None else self.stop - self.start

    def row_index(self) -> list[int]:
        return list(self.rows) if self.rows is not None else list(range(self.start, self.stop))

    def _select(self, t: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return t[self.start:self.stop]
        return t[torch.tensor(self.rows, device=t.device)]

    def weight_tensor(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """This process's rows (its shard of a tensor-parallel weight, whose graph it is)."""
        w = local_tensor(params[self.weight])
        w = w.t() if self.transposed else w
        return self._select(w)

    def bias_tensor(self, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self._select(local_tensor(params[self.bias]))


@dataclass(frozen=True)
class RopeLayout:
    """How rotary embedding pairs the dims of one head.

    ``style``: ``"none"``, ``"half"`` (pairs ``(t, t + rotary_dim/2)``, rotate_half) or
    ``"interleaved"`` (pairs ``(2t, 2t+1)``). The first ``rotary_dim`` dims of a head rotate;
    the rest pass through (partial rotary). ``turn``: ``-1`` where the model turns each pair
    the other way, by ``-θ`` for the ``(cos θ, sin θ)`` it computes (NanoChat's
    ``rotate_half(x) = cat(x2, -x1)``: pairs ``(t + rotary_dim/2, t)`` as the matcher reads
    them); the same pairs turned by the opposite angle, so what uses the model's angles
    (``RotaryLog``) negates ``sin`` and nothing else changes.
    """

    style: str = "none"
    rotary_dim: int = 0
    turn: int = 1

    def __post_init__(self):
        if self.style not in ("none", "half", "interleaved"):
            raise ValueError(f"unknown RoPE style {self.style!r}")
        if self.style == "none" and self.rotary_dim:
            raise ValueError("RoPE style 'none' cannot rotate any dims")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        if self.turn not in (1, -1):
            raise ValueError(f"turn must be 1 or -1, got {self.turn}")

    def pairs(self) -> list[tuple[int, int]]:
        """Index pairs ``(re, im)`` within a head, one per rotary frequency."""
        half = self.rotary_dim // 2
        if self.style == "half":
            return [(t, t + half) for t in range(half)]
        if self.style == "interleaved":
            return [(2 * t, 2 * t + 1) for t in range(half)]
        return []


NO_ROPE = RopeLayout()


@dataclass
class GraphNodes:
    """Where one attention block sits in one FX graph (valid for that graph only); a field is
    ``None`` where the matcher did not find it."""

    attention: Node                   # SDPA node, or the probs @ v matmul of manual attention
    query: Node | None = None         # inputs as the attention op reads them
    key: Node | None = None           # (k^T when key_transposed; cached keys joined)
    value: Node | None = None
    key_transposed: bool = False
    q_linear: Node | None = None      # projection nodes (a fused qkv linear appears thrice)
    k_linear: Node | None = None
    v_linear: Node | None = None
    o_linear: Node | None = None
    attn_output: Node | None = None   # the o projection's input (heads merged)
    q_rope: Any = None                # rope_match.RopeMatch: output, input, cos/sin tables
    k_rope: Any = None
    key_pre_rope: Node | None = None  # keys per KV head just before RoPE (None without RoPE)
    key_states: Node | None = None    # post-RoPE keys per KV head, as a KV cache receives them
    value_states: Node | None = None
    key_cache: Node | None = None     # the cat joining cached keys, or the in-place write
    value_cache: Node | None = None   # (index_copy_) into a cache buffer
    q_trace: Any = None               # path_walk.Path: the steps from each projection
    k_trace: Any = None
    v_trace: Any = None


@dataclass
class AttentionBlock:
    """One attention block found in a graph, in execution order.

    ``nodes`` ties the block to the graph it was matched in (the compile passes rewrite
    there); ``lorc_fx.analyze`` drops it, since its graphs are gone once it returns.
    """

    layer: int
    q: Projection | None
    k: Projection | None
    v: Projection | None
    o: Projection | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_q: RopeLayout = NO_ROPE
    rope_k: RopeLayout = NO_ROPE
    scale: float | None = None
    q_path: str = "none"  # between Q projection and attention, as for k_path
    k_path: str = "none"  # between K projection and cache: none | rope | norm | other
    v_path: str = "none"
    q_scale: float = 1.0  # constant factors on the query / key paths (OPT), folded into scale
    k_scale: float = 1.0
    attention_op: str = "sdpa"  # sdpa | sdpa_gqa | manual
    supported: bool = True
    reason: str = ""
    notes: dict = field(default_factory=dict)
    # tensor parallel: which shard of the K/V heads this process holds; heads, rows and
    # projections above are this process's (None: the weights are whole here)
    sharding: Sharding | None = None
    nodes: GraphNodes | None = field(default=None, repr=False, compare=False)

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict:
        return {f.name: _json(getattr(self, f.name)) for f in fields(self) if f.name != "nodes"}


def _json(value):
    return asdict(value) if hasattr(value, "__dataclass_fields__") else value


def attention_module(model: nn.Module, block: AttentionBlock) -> nn.Module:
    """The module that owns every projection found of a block (query, key, value, output:
    a gated output, as Qwen3-Next's, has no output projection found)."""
    return model.get_submodule(".".join(attention_path(block)))


def attention_path(block: AttentionBlock) -> list[str]:
    """The module path that :func:`attention_module` names, split at its dots."""
    names = [p.weight.split(".")[:-1] for p in (block.q, block.k, block.v, block.o) if p]
    return [parts[0] for parts in takewhile(lambda parts: len(set(parts)) == 1, zip(*names))]


def named_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))
