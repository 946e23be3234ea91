"""Statistics of each layer's attention, measured inside the model's own attention call.

The data-aware basis (``lorc_fx.metrics``) needs, per layer, how much an error in a cached
key or value direction changes that layer's attention output. Those depend on the attention
probabilities, which no hook outside the attention function sees. transformers routes
attention through its ``AttentionInterface``; registering a function there (under
``PROBE``) gives us query, post-RoPE keys and values in cache layout, for any model that uses
the interface, with no per-architecture code.

Per layer (``D = h_kv·d``, cache coordinates; averages over query heads and positions):

- ``values[j]``: ``E[ṽ ṽᵀ]`` over the query heads of group ``j``, where ``ṽ = Σ_n p_n v_n`` is
  the attention average of the *full* value vector. Dropping a basis row ``u`` changes head
  ``i``'s output by ``u_{g(i)}·(uᵀṽ)``, exactly.
- ``keys``: ``E Σ_n w_n (k_n − k̄)(k_n − k̄)ᵀ`` with ``w_n = p_n·‖v_n − o‖²`` and ``k̄ = Σ p_n k_n``;
  ``queries``: ``E[q̄ q̄ᵀ]``, ``q̄`` the query embedded in its group's block. To first order a
  score error ``δ_n`` moves the output by ``Σ_n p_n (δ_n − δ̄) (v_n − o)``; with
  ``δ_n = s·q·Δk_n`` its energy is ``≈ s²·(uᵀ queries u)(uᵀ keys u)`` for a dropped row ``u``.
- ``output_energy``: ``E‖o‖²`` per head and position, the layer's own scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PROBE = "lorc_probe"


@dataclass
class AttentionMoments:
    values: torch.Tensor  # (h_kv, D, D) float64
    keys: torch.Tensor  # (D, D)
    queries: torch.Tensor  # (D, D), block diagonal
    output_energy: float
    scale: float


class _Accumulator:
    def __init__(self):
        self.sums: dict[str, torch.Tensor | float] = {}
        self.count = 0
        self.scale = 0.0
        self.calls = 0

    def add(self, name: str, value) -> None:
        self.sums[name] = self.sums.get(name, 0) + value

    def moments(self) -> AttentionMoments:
        s, n = self.sums, self.count
        return AttentionMoments(s["values"] / n, s["keys"] / n, s["queries"] / n,
                                float(s["output"]) / n, self.scale / self.calls)


def _probabilities(query, key, mask, scaling, softcap=None, sinks=None):
    """The attention probabilities over the keys; ``softcap`` caps the scores as
    ``cap · tanh(s / cap)`` (Gemma 2), ``sinks`` is a logit per head that takes its share of
    each softmax and is dropped (gpt-oss's ``s_aux``)."""
    groups = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(groups, 1).transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:  # no mask tensor: the causal mask is implied
        t, n = scores.shape[-2:]
        causal = torch.ones(t, n, dtype=torch.bool, device=scores.device).tril(n - t)
        scores = scores.masked_fill(~causal, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask[..., : key.shape[2]]
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]


@torch.no_grad()
def _accumulate(acc: _Accumulator, query, key, value, p, out) -> None:
    b, h, t, d = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    groups, width = h // h_kv, h_kv * d
    keys = key.transpose(1, 2).reshape(b, 1, n, width).float()
    values = value.transpose(1, 2).reshape(b, 1, n, width).float()
    p = p.float()

    averaged = (p @ values).double()  # (b, h, t, D): attention average of full value vectors
    value_moments = torch.stack([
        (lambda f: f.T @ f)(averaged[:, j * groups:(j + 1) * groups].reshape(-1, width))
        for j in range(h_kv)])
    acc.add("values", value_moments)

    out = out.float()  # (b, h, t, d)
    head_values = value.float().repeat_interleave(groups, 1)  # (b, h, n, d)
    spread = (head_values.square().sum(-1)[:, :, None, :] - 2 * out @ head_values.transpose(-1, -2)
              + out.square().sum(-1, keepdim=True)).clamp_min(0)
    w = p * spread  # (b, h, t, n)
    mean_key = (p @ keys).double().reshape(-1, width)  # k̄ per (head, position)
    weighted = (w @ keys).double().reshape(-1, width)  # Σ_n w_n k_n
    total = w.sum(-1).double().reshape(-1, 1)
    received = w.sum((1, 2)).double().reshape(-1, 1)  # Σ over heads and positions, per key
    k = keys.double().reshape(-1, width)
    # Σ w_n (k_n − k̄)(k_n − k̄)ᵀ = Σ_n w_n k_n k_nᵀ − (k̄ᵀW + Wᵀk̄ − k̄ᵀ(total·k̄)) per (head,
    # position), the bracket X + Xᵀ with X = k̄ᵀ(W − total·k̄/2): one product over the
    # heads' positions instead of three
    cross = mean_key.T @ (weighted - total / 2 * mean_key)
    acc.add("keys", (k * received).T @ k - cross - cross.T)

    q = query.double()
    blocks = [sum((lambda f: f.T @ f)(q[:, i].reshape(-1, d)) for i in range(j * groups, (j + 1) * groups))
              for j in range(h_kv)]
    acc.add("queries", torch.block_diag(*blocks))
    acc.add("output", float(out.double().square().sum()))
    acc.count += b * h * t


class AttentionProbe:
    """While active, every attention call of ``model`` whose module belongs to one of
    ``layers`` (module id -> layer) also accumulates that layer's moments."""

    _active: "AttentionProbe | None" = None

    def __init__(self, model: nn.Module, layers: dict[int, int]):
        self.model = model
        self.layers = layers
        self.accumulators: dict[int, _Accumulator] = {}

    def __enter__(self) -> "AttentionProbe":
        if not probe_supported(self.model):
            raise ValueError(
                f"{type(self.model).__name__} does not route attention through transformers' "
                "AttentionInterface, so its attention cannot be measured")
        _register()
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(PROBE)
        AttentionProbe._active = self
        return self

    def __exit__(self, *exc) -> None:
        AttentionProbe._active = None
        self.model.set_attn_implementation(self._previous)

    def moments(self) -> dict[int, AttentionMoments]:
        return {layer: acc.moments() for layer, acc in self.accumulators.items()}

    def observe(self, module, query, key, value, p, out, scaling) -> None:
        layer = self.layers.get(id(module))
        if layer is None:
            return
        acc = self.accumulators.setdefault(layer, _Accumulator())
        _accumulate(acc, query, key, value, p, out)
        acc.scale += scaling
        acc.calls += 1


def probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    softcap=None, s_aux=None, **kwargs):
    """An ``AttentionInterface`` function: softmax attention (softcapped scores and sink
    logits as the model asks) that reports to the active probe. Returns ``(b, t, h, d)``
    like the built-in implementations."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    p = _probabilities(query, key, attention_mask, scaling, softcap, s_aux)
    out = p.to(value.dtype) @ value.repeat_interleave(query.shape[1] // key.shape[1], 1)
    if AttentionProbe._active is not None:
        AttentionProbe._active.observe(module, query, key, value, p, out, scaling)
    return out.transpose(1, 2).contiguous(), None


def probe_supported(model: nn.Module) -> bool:
    """Whether ``model`` dispatches attention through transformers' ``AttentionInterface``."""
    return bool(getattr(model, "_can_set_attn_implementation", lambda: False)())


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE, probe_attention)
    AttentionMaskInterface.register(PROBE, sdpa_mask)


def attention_modules(model: nn.Module, weight_names: dict[int, str]) -> dict[int, int]:
    """``id(module) -> layer`` for every ancestor module of each layer's K weight that
    belongs to that layer alone (the attention module a probe call names is one of them)."""
    owners: dict[int, set[int]] = {}
    for layer, name in weight_names.items():
        parts = name.split(".")[:-1]
        for i in range(len(parts), 0, -1):
            owners.setdefault(id(model.get_submodule(".".join(parts[:i]))), set()).add(layer)
    return {mid: next(iter(ls)) for mid, ls in owners.items() if len(ls) == 1}
