"""How much the model's loss minds an error in each cached latent channel (diagonal Fisher).

An allocation of bits needs one unit for the errors of every channel of every layer and
side. The spectra's energies are one within a side but misjudge layers and keys against
values: an error in a latent costs what it moves the loss, not what it moves the keys. To
second order, a small error ``δ`` in the latent ``z`` of one token raises the loss by about
``½ Σ_c F_c δ_c²`` with ``F_c = E[(∂L/∂z_c)²]`` (the Fisher information's diagonal, its
cross terms left out); an error of relative size ``ρ_c`` (``E[δ_c²] = ρ_c·E[z_c²]``) raises
it by ``½ Σ_c F_c·E[z_c²]·ρ_c``. So ``F_c·E[z_c²]`` is the weight of channel ``c``'s
relative error; it does not change when a channel is scaled.

Measured on the uncompressed model: one forward and backward per batch of calibration
windows, the gradients taken at the K and V projections' outputs (the loss's total
derivative, through every later layer; the weights need none and get none, and are left as
they were) and carried into the latent by the basis' rebuild rows (keys ≈ Bᵀ·z, so
∂L/∂z = B·∂L/∂keys). That holds where the cached latent is a linear image of the
projection's rows: values, keys without RoPE and keys cached before RoPE. A side whose
latent is not (keys behind a norm, keys cached after RoPE) has none:
:func:`sensitivities_and_latents` returns ``None`` and the caller keeps the energies. Each
window's first token (the sink, never coded) is left out.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from .calibration import owner_module
from .planner import LayerPlan, Plan

Side = tuple[int, str]  # (layer, "k" or "v")


def _linear_in_projection(block: AttentionBlock, layer: LayerPlan, side: str) -> bool:
    """Whether ``layer``'s cached latent of ``side`` is ``P·(projection rows)``."""
    if side == "v":
        return block.v_path == "none"
    return block.k_path == "none" or (block.k_path == "rope" and layer.k_latent_of == "pre_rope")


def _rows(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A projection's output ``(batch, n, out)`` at ``rows`` as ``(batch·(n-1), rows)``
    float64, each window's first token left out."""
    return out[:, 1:].index_select(-1, rows).reshape(-1, len(rows)).double()


def sensitivities_and_latents(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                              sides: list[Side], windows: torch.Tensor, batch_size: int = 2,
                              keep_latents: bool = True
                              ) -> tuple[dict[Side, torch.Tensor], dict[Side, torch.Tensor]] | None:
    """Per side of ``sides`` (coded by the full-rank ``full``), ``F_c·E[z_c²]`` of each latent
    channel over ``windows``, float64, and with ``keep_latents`` the latents ``z`` themselves
    from the same forward, ``(samples, r)`` float32, each window's first token left out (else
    none): the samples the books are fitted on (``search.codebooks``; the projection's rows
    taken by ``P`` here rather than by the cache, the same up to rounding), so that a first
    plan runs the calibration text once for both. ``None`` where a side's latent is not linear
    in its projection's output (shows progress: a forward and backward per batch)."""
    block = {b.layer: b for b in blocks}
    layer = {l.layer: l for l in full.layers}
    if not all(_linear_in_projection(block[l], layer[l], s) for l, s in sides):
        return None
    device = next(model.parameters()).device
    # per side: the module whose output holds it, its rows there, P and B (read once)
    reads = {(l, s): (owner_module(getattr(block[l], s).weight),
                      torch.tensor(getattr(block[l], s).row_index(), device=device),
                      getattr(layer[l], f"{s}_basis").to(device),
                      getattr(layer[l], f"{s}_rebuild").to(device)) for l, s in sides}
    outputs: dict[str, torch.Tensor] = {}
    shifts: dict[str, torch.Tensor] = {}

    def add_zero_leaf(name):
        def hook(module, args, out):
            # a zero added as a leaf: its gradient is the loss's total derivative by the
            # output, through every later layer (cutting the output from its inputs instead
            # would drop the paths from earlier layers through this one)
            outputs[name], shifts[name] = out.detach(), torch.zeros_like(out, requires_grad=True)
            return out + shifts[name]
        return hook

    owners = sorted({name for name, *_ in reads.values()})
    handles = [model.get_submodule(m).register_forward_hook(add_zero_leaf(m)) for m in owners]
    needs_grad = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    fisher = {s: 0.0 for s in sides}
    power = {s: 0.0 for s in sides}
    latents: dict[Side, list[torch.Tensor]] = {s: [] for s in sides} if keep_latents else {}
    tokens = 0
    try:
        for batch in tqdm(windows.split(batch_size), desc="lorc: measuring the loss's "
                          "sensitivity to each latent channel", unit="batch", mininterval=1.0):
            batch = batch.to(device)
            with torch.enable_grad():
                logits = model(batch, use_cache=False).logits[:, :-1].float()
                torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                  batch[:, 1:].reshape(-1),
                                                  reduction="sum").backward()
            for side, (name, rows, basis, rebuild) in reads.items():
                z = _rows(outputs[name], rows) @ basis.T
                dz = _rows(shifts[name].grad, rows) @ rebuild.T
                fisher[side] = fisher[side] + (dz ** 2).sum(0).cpu()
                power[side] = power[side] + (z ** 2).sum(0).cpu()
                if keep_latents:
                    latents[side].append(z.float().cpu())
            tokens += batch[:, 1:].numel()
            outputs.clear()
            shifts.clear()
    finally:
        for h in handles:
            h.remove()
        for p, flag in zip(model.parameters(), needs_grad):
            p.requires_grad_(flag)
    return ({s: fisher[s] * power[s] / tokens ** 2 for s in sides},
            {s: torch.cat(parts) for s, parts in latents.items()})
