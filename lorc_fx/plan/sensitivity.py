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

What the pass keeps does not depend on the basis: per K and V projection, the second
moments of its output rows ``y`` and of their gradients ``g`` (``D × D``) and the rows
themselves (:class:`ProjectionMoments`); a basis ``P`` with rebuild ``B`` then gives
``E[z_c²] = (P·E[yyᵀ]·Pᵀ)_cc``, ``F_c = (B·E[ggᵀ]·Bᵀ)_cc`` and the latents ``y·Pᵀ``
(:func:`sensitivities`). So a first plan measures them in the calibration pass that
measures the bases' statistics (:func:`calibration_with_gradients`): one pass over the
calibration text fewer.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers.modeling_layers import GradientCheckpointingLayer

from lorc_fx.analysis.records import AttentionBlock
from .calibration import CalibrationUnavailable, cache_path, measure_statistics, owner_module
from .options import CalibrationOptions
from .planner import LayerPlan, Plan

Side = tuple[int, str]  # (layer, "k" or "v")


@dataclass
class ProjectionMoments:
    """Per side, over calibration windows (each window's first token left out): ``grams``
    ``Σ y yᵀ`` and ``gradients`` ``Σ g gᵀ`` of the projection's output rows ``y`` and the
    loss's total derivative ``g`` by them, ``(D, D)`` float64; the ``rows`` ``(samples, D)``
    float32 where kept; the ``tokens`` summed over."""

    grams: dict[Side, torch.Tensor]
    gradients: dict[Side, torch.Tensor]
    rows: dict[Side, torch.Tensor]
    tokens: int


def _linear_in_projection(block: AttentionBlock, layer: LayerPlan, side: str) -> bool:
    """Whether ``layer``'s cached latent of ``side`` is ``P·(projection rows)``."""
    if side == "v":
        return block.v_path == "none"
    return block.k_path == "none" or (block.k_path == "rope" and layer.k_latent_of == "pre_rope")


def _all_linear(blocks: list[AttentionBlock], full: Plan, sides: list[Side]) -> bool:
    """Whether every side's latent in ``full`` is linear in its projection's output."""
    block = {b.layer: b for b in blocks}
    layer = {l.layer: l for l in full.layers}
    return all(_linear_in_projection(block[l], layer[l], s) for l, s in sides)


def projection_rows(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A projection's output ``(batch, n, out)`` at ``rows`` as ``(batch·(n-1), rows)``
    float64, each window's first token left out."""
    return out[:, 1:].index_select(-1, rows).reshape(-1, len(rows)).double()


@contextmanager
def _recomputed(layer: nn.Module) -> Iterator[None]:
    """While entered, ``layer``'s forward keeps only its inputs for the backward and runs
    again there (``torch.utils.checkpoint``, non-reentrant)."""
    own = layer.__dict__.get("forward")  # a forward set on the instance, restored after
    forward = layer.forward
    layer.forward = lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False,
                                                       **kwargs)
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


class ProjectionRecorder:
    """While entered, the output of every module holding a K or V weight of ``sides`` gets
    a zero added as a leaf (its gradient is the loss's total derivative by the output,
    through every later layer; cutting the output from its inputs instead would drop the
    paths from earlier layers through this one), and the model's weights need no gradient
    (their flags are restored on leaving). :meth:`backward` runs each batch's backward and
    adds its moments.

    With ``recompute_layers`` each decoder layer transformers can checkpoint
    (``GradientCheckpointingLayer``) keeps only its inputs for the backward and runs again
    there; a model without such layers runs as it is (the answer pass through 2048 tokens on
    the default model: 3.7 GB peak, 5.5 GB without; docs/schemes/vector.md). Invariant: each
    projection runs once a forward, whose leaf the recompute adds again (the backward reaches
    it through the first forward's graph), and :meth:`forget` follows every forward."""

    def __init__(self, model: nn.Module, blocks: list[AttentionBlock], sides: list[Side],
                 keep_rows: bool = True, recompute_layers: bool = False):
        block = {b.layer: b for b in blocks}
        self.model, self.keep_rows = model, keep_rows
        self.recomputed = [m for m in model.modules()
                           if recompute_layers and isinstance(m, GradientCheckpointingLayer)]
        device = next(model.parameters()).device
        self.reads = {(l, s): (owner_module(getattr(block[l], s).weight),
                               torch.tensor(getattr(block[l], s).row_index(), device=device))
                      for l, s in sides}
        self.outputs: dict[str, torch.Tensor] = {}
        self.shifts: dict[str, torch.Tensor] = {}
        self.grams = {s: 0.0 for s in sides}
        self.gradients = {s: 0.0 for s in sides}
        self.rows: dict[Side, list[torch.Tensor]] = {s: [] for s in sides} if keep_rows else {}
        self.tokens = 0

    def __enter__(self) -> "ProjectionRecorder":
        def add_zero_leaf(name):
            def hook(module, args, out):
                if not (self.recomputed and name in self.shifts):  # else: the recompute
                    self.outputs[name] = out.detach()
                    self.shifts[name] = torch.zeros_like(out, requires_grad=True)
                return out + self.shifts[name]
            return hook

        owners = sorted({name for name, _ in self.reads.values()})
        self.handles = [self.model.get_submodule(m).register_forward_hook(add_zero_leaf(m))
                        for m in owners]
        self.needs_grad = [p.requires_grad for p in self.model.parameters()]
        self.model.requires_grad_(False)
        self.recomputing = ExitStack()
        for layer in self.recomputed:
            self.recomputing.enter_context(_recomputed(layer))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.recomputing.close()
        for p, flag in zip(self.model.parameters(), self.needs_grad):
            p.requires_grad_(flag)

    def backward(self, batch: torch.Tensor, logits: torch.Tensor) -> None:
        """Backpropagate the summed next-token loss of ``batch`` from its ``logits`` (a
        forward with gradients, under this recorder) and add the batch's moments."""
        logits = logits[:, :-1].float()
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          batch[:, 1:].reshape(-1), reduction="sum").backward()
        for side, (name, rows) in self.reads.items():
            y = projection_rows(self.outputs[name], rows)
            g = projection_rows(self.shifts[name].grad, rows)
            self.grams[side] = self.grams[side] + (y.T @ y).cpu()
            self.gradients[side] = self.gradients[side] + (g.T @ g).cpu()
            if self.keep_rows:
                self.rows[side].append(y.float().cpu())
        self.tokens += batch[:, 1:].numel()
        self.forget()

    def forget(self) -> None:
        """Let go of the last forward's outputs and their gradients' leaves."""
        self.outputs.clear()
        self.shifts.clear()

    def moments(self) -> ProjectionMoments:
        return ProjectionMoments(self.grams, self.gradients,
                                 {s: torch.cat(parts) for s, parts in self.rows.items()},
                                 self.tokens)


def measure_projections(model: nn.Module, blocks: list[AttentionBlock], sides: list[Side],
                        windows: torch.Tensor, batch_size: int = 2, keep_rows: bool = True
                        ) -> ProjectionMoments:
    """The moments of ``sides``' projections over ``windows``: a forward and backward per
    batch (shows progress)."""
    device = next(model.parameters()).device
    with ProjectionRecorder(model, blocks, sides, keep_rows) as recorder:
        for batch in tqdm(windows.split(batch_size), desc="lorc: measuring the loss's "
                          "sensitivity to each latent channel", unit="batch", mininterval=1.0):
            batch = batch.to(device)
            with torch.enable_grad():
                recorder.backward(batch, model(batch, use_cache=False).logits)
    return recorder.moments()


def calibration_with_gradients(model: nn.Module, blocks: list[AttentionBlock],
                               options: CalibrationOptions) -> ProjectionMoments | None:
    """Where the statistics of ``options`` are not on disk: one forward and backward per
    batch of their windows measures them (written where ``calibration.layer_statistics``
    reads them) and the moments of every supported block's K and V projections, returned;
    else ``None``, as where no calibration text can be had (the caller's basis says why)."""
    if cache_path(model, blocks, options).is_file():
        return None
    sides = [(b.layer, side) for b in blocks if b.supported for side in ("k", "v")]
    try:
        with ProjectionRecorder(model, blocks, sides) as recorder:
            measure_statistics(model, blocks, options, backward=recorder.backward)
    except CalibrationUnavailable:
        return None
    return recorder.moments()


def sensitivities(moments: ProjectionMoments, blocks: list[AttentionBlock], full: Plan,
                  sides: list[Side]
                  ) -> tuple[dict[Side, torch.Tensor], dict[Side, torch.Tensor]] | None:
    """Per side of ``sides`` (coded by the full-rank ``full``), ``F_c·E[z_c²]`` of each latent
    channel, float64, and where ``moments`` kept the rows, the latents ``z`` ``(samples, r)``
    float32 (else none): the samples the books are fitted on (``search.codebooks``; the
    projection's rows taken by ``P`` here rather than by the cache, the same up to rounding).
    ``None`` where a side's latent is not linear in its projection's output."""
    if not _all_linear(blocks, full, sides):
        return None
    layer = {l.layer: l for l in full.layers}
    weights, latents = {}, {}
    for side in sides:
        basis = getattr(layer[side[0]], f"{side[1]}_basis").double()
        rebuild = getattr(layer[side[0]], f"{side[1]}_rebuild").double()
        fisher = ((rebuild @ moments.gradients[side]) * rebuild).sum(1)
        power = ((basis @ moments.grams[side]) * basis).sum(1)
        weights[side] = fisher * power / moments.tokens ** 2
        if side in moments.rows:
            latents[side] = (moments.rows[side].double() @ basis.T).float()
    return weights, latents


def sensitivities_and_latents(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                              sides: list[Side], windows: torch.Tensor, batch_size: int = 2,
                              keep_latents: bool = True
                              ) -> tuple[dict[Side, torch.Tensor], dict[Side, torch.Tensor]] | None:
    """:func:`sensitivities` measured on ``windows`` (:func:`measure_projections`), the
    latents with ``keep_latents``; ``None``, measuring nothing, where a side's latent is not
    linear in its projection's output."""
    if not _all_linear(blocks, full, sides):
        return None
    moments = measure_projections(model, blocks, sides, windows, batch_size, keep_latents)
    return sensitivities(moments, blocks, full, sides)
