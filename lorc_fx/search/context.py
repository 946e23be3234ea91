"""What the storage schemes plan their candidates from: one model, its attention blocks, the
options asked, and the choices the search tries (RoPE modes, latent bit widths, group sizes),
with what several candidates share computed once."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn
from transformers.cache_utils import DynamicCache

from lorc_fx.analysis.cache_probe import probe_cache
from lorc_fx.analysis.records import AttentionBlock, attention_module, named_params
from lorc_fx.cache import codes_own_states, layers_kept_as_built, replaceable, sliding_windows
from lorc_fx.plan.bases import resolve
from lorc_fx.plan.options import AUTO, LATENT_BITS, LATENT_GROUPS, PlanOptions
from lorc_fx.plan.planner import (LayerInput, Plan, cache_layer_input, layer_inputs,
                                  sliding_note)

# bases measured on calibration text; with them the calibrated schedule measures its split too
CALIBRATED_BASES = frozenset({"whitened", "attention"})


def calibrated_basis(basis: str) -> bool:
    """Whether planning with ``basis`` measures a basis on calibration text (``auto`` picks
    the best calibration allows)."""
    return basis == "auto" or basis in CALIBRATED_BASES


def _never_skipped() -> str | None:
    return None


@dataclass
class Candidate:
    """One plan a scheme offers: ``build()`` plans it and measures its held-out loss (``None``
    where the search measures nothing), or raises ``UnreachableFraction`` where it does not
    fit the budget; ``skipped()``, asked first, says why the candidates measured before it
    show it need not be (``None``: it is built)."""

    name: str
    scheme: str
    build: Callable[[], tuple[Plan, float | None]]
    rope: str = "commute"
    latent_bits: int = 16
    latent_group: int = LATENT_GROUPS[0]
    skipped: Callable[[], str | None] = _never_skipped


class Skipped(Exception):
    """A candidate the search need not measure, found while building it: those measured
    before it show that it loses (its message says how, without the candidate's name)."""


@dataclass
class SearchContext:
    """``options`` as the search plans them (the calibration text usable, the shards and the
    basis resolved; ``rope``, ``latent_bits`` and ``latent_group`` still as asked), the
    ``modes``, ``widths`` and ``groups`` tried, and whether candidates are ``measure``d."""

    model: nn.Module
    blocks: list[AttentionBlock]
    options: PlanOptions
    modes: list[str]
    widths: tuple[int, ...]
    groups: tuple[int, ...]
    measure: bool
    calibrates: bool = False  # a basis or a target measured on calibration text
    # the keys' share measured per (rope, bits) at this budget, reused by further groups
    splits: dict[tuple[str, int], float] = field(default_factory=dict)
    # the least held-out loss of a low-rank candidate per (rope, bits) at this budget
    width_losses: dict[tuple[str, int], float] = field(default_factory=dict)
    # the least held-out loss of each scheme measured at this budget: a scheme may skip the
    # candidates another's plan covers (low rank where vector codes planned)
    scheme_losses: dict[str, float] = field(default_factory=dict)
    # what does not depend on the budget, shared by the contexts ``at_budget`` makes
    _inputs: list[LayerInput] | None = None
    _declined: list[LayerInput] | None = None
    _prepared: dict[str, tuple[str, list[LayerInput], str]] = field(default_factory=dict)

    @property
    def searched(self) -> bool:
        """Whether the storage is searched (``latent_bits="auto"`` where candidates can be
        measured): only then do the schemes other than low rank at one width offer plans."""
        return len(self.widths) > 1

    def candidate_options(self, rope: str, latent_bits: int, latent_group: int,
                          **more) -> PlanOptions:
        return replace(self.options, rope=rope, latent_bits=latent_bits,
                       latent_group=latent_group, **more)

    def at_budget(self, cache_fraction: float, measure: bool) -> "SearchContext":
        """The search at another cache fraction (the target's search measures several)."""
        options = replace(self.options, cache_fraction=cache_fraction, bits_per_value=None,
                          max_ppl_increase=None)
        return replace(self, options=options, measure=measure, splits={}, width_losses={},
                       scheme_losses={})

    def layer_inputs(self) -> list[LayerInput]:
        """The layers' weights and layouts, with the layers transformers builds its own cache
        layer for marked (they stay full, as built)."""
        if self._inputs is None:
            self._inputs = model_layer_inputs(self.model, self.blocks, self.options.shards)
        return self._inputs

    def declined_inputs(self) -> list[LayerInput]:
        """The layers whose transformers cache holds keys and values but no supported block
        proves (declined, or not found), known by their cache's shapes alone: plain plans
        code them too, other schemes leave them as transformers stores them. None over
        shards (the probe would run the model on one process)."""
        if self._declined is None:
            self._declined = ([] if (self.options.shards or 1) > 1 else declined_layer_inputs(
                self.model, self.blocks, "the analysis found no attention block writing it"))
        return self._declined

    def prepared(self, rope: str) -> tuple[PlanOptions, list[LayerInput], str]:
        """For RoPE mode ``rope``: the options with the basis resolved, the layers' inputs
        with the bases' metrics attached, and the basis note (once per mode)."""
        if rope not in self._prepared:
            options = replace(self.options, rope=rope)
            basis, metrics, note = resolve(options.basis, self.model, self.blocks, options)
            inputs = model_layer_inputs(self.model, self.blocks, options.shards)
            block_of = {b.layer: b for b in self.blocks}
            for layer in inputs:
                metric = metrics.get(layer.layer)
                if metric is not None:
                    layer.input_gram = metric.input_gram
                    layer.k_spectrum, layer.v_spectrum = metric.k_spectrum, metric.v_spectrum
                    if metric.k_of_cached_keys and not layer.compress_k \
                            and not layer.kept_as_built and block_of[layer.layer].k_path == "norm":
                        layer.compress_k, layer.keys_after_rope = True, True
                        why = "keys behind a norm: basis of the keys the cache receives"
                        layer.note = f"{layer.note}; {why}" if layer.sliding_window else why
                if layer.sliding_window and layer.compress_k and rope == "reconstruct" \
                        and layer.rope.style != "none" and not layer.keys_after_rope:
                    layer.compress_k = False  # no angle log in a ring: keys kept as they come
                    layer.note += ("; keys as they come, after RoPE: rebuilding a window's keys "
                                   "from latents before RoPE would need the angles of its "
                                   "own positions")
            self._prepared[rope] = basis, inputs, note
        basis, inputs, note = self._prepared[rope]
        return replace(self.options, rope=rope, basis=basis), inputs, note


def model_layer_inputs(model: nn.Module, blocks: list[AttentionBlock], shards: int
                       ) -> list[LayerInput]:
    """:func:`~lorc_fx.plan.planner.layer_inputs` of ``model``, with the layers transformers
    builds its own cache layer for marked (they stay full, as built), and its sliding-window
    layers with their windows (compressible as full layers are, but see
    ``LayerInput.sliding_window``). A layer whose
    cache layer holds nothing (``dummy``: Gemma-3n's last layers read an earlier layer's keys
    and values) is not planned: it costs no bytes."""
    config = getattr(model, "config", None)
    kept, sliding = layers_kept_as_built(config), sliding_windows(config)
    blocks = [b for b in blocks if kept.get(b.layer) != "dummy"]
    inputs = layer_inputs(named_params(model), blocks, shards)
    for layer in inputs:
        if layer.layer in kept:
            layer.compress_k = layer.compress_v = False
            layer.kept_as_built = True
            layer.note = (f"kept full: transformers builds its own {kept[layer.layer]} cache "
                          "layer here")
        elif layer.layer in sliding:
            kind, window = sliding[layer.layer]
            layer.sliding_window, layer.sliding_kind = window, kind
            layer.note = sliding_note(kind, window)
    return inputs


def declined_layer_inputs(model: nn.Module, blocks: list[AttentionBlock], why: str
                          ) -> list[LayerInput]:
    """A :func:`~lorc_fx.plan.planner.cache_layer_input` for each layer whose transformers
    cache holds keys and values (``analysis.cache_probe``, one short forward) and that no supported
    block covers, its note giving the block's reason (else ``why``)."""
    proven = {b.layer for b in blocks if b.supported}
    if proven and len(proven) == len(blocks) and not _more_cache_layers(model, proven):
        return []
    probe = probe_cache(model)
    if probe is None or probe.cache_class is not DynamicCache:  # a model's own: not replaced
        return []
    found = [c for c in probe.layers if c.layer not in proven
             and (replaceable(c.kind) or codes_own_states(c.kind))]
    if not found:
        return []
    reasons = {b.layer: b.reason for b in blocks if not b.supported and b.reason}
    heads = {b.layer: b.num_heads for b in blocks if b.num_heads}
    config = model.config.get_text_config(decoder=True)
    try:  # a config whose layers differ raises for the whole-model value (dots3_note)
        every = getattr(config, "num_attention_heads", None)
    except RuntimeError:
        every = None
    sliding = sliding_windows(config)
    return [cache_layer_input(c.layer, heads.get(c.layer) or every or c.kv_heads, c.kv_heads,
                              c.k_head_dim, c.v_head_dim, reasons.get(c.layer, why),
                              sliding.get(c.layer),
                              c.kind.__name__ if codes_own_states(c.kind) else "")
            for c in found]


def _more_cache_layers(model: nn.Module, proven: set[int]) -> bool:
    """Whether the model's config has key/value cache layers beyond the ``proven`` ones (then
    the cache is probed for them)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    layers = getattr(text, "num_hidden_layers", None)
    if layers is None:
        return True
    return len(proven) + len(layers_kept_as_built(config)) < layers


def rope_modes(rope: str, model: nn.Module, blocks: list[AttentionBlock],
               objective: str = "quality") -> list[str]:
    """The RoPE modes to plan: ``auto`` tries ``commute`` and, for ``objective="quality"``
    where every rotary attention module takes the step's angles as ``position_embeddings``
    (the latent cache needs them to rotate rebuilt keys), ``reconstruct``; for
    ``objective="speed"`` one mode, ``reconstruct`` where the angles are handed (its keys
    then in a RoPE-commuting basis, ``PlanOptions.rope_commuting_keys``: decode scores them
    per rotary pair without rebuilding them, and they code better than keys cached after
    RoPE: docs/schemes/vector.md), else ``commute``. An explicit ``reconstruct`` on a model
    whose attention does not take the angles is refused."""
    rotary = [b for b in blocks if b.supported and b.rope_k.style != "none"]
    hands_angles = all(
        "position_embeddings" in inspect.signature(attention_module(model, b).forward).parameters
        for b in rotary)
    if rope == AUTO:
        if not (rotary and hands_angles):
            return ["commute"]
        return ["commute", "reconstruct"] if objective == "quality" else ["reconstruct"]
    if rope == "reconstruct" and not hands_angles:
        raise ValueError(
            f"rope='reconstruct' needs the RoPE angles of each step, but the attention modules "
            f"of {type(model).__name__} do not take `position_embeddings`; use rope='commute'")
    return [rope]


def bit_choices(latent_bits: int | str, searchable: bool) -> tuple[int, ...]:
    """The latent bit widths to plan: the one asked, else (``"auto"``) all of
    ``LATENT_BITS`` where the plan can measure them (``searchable``), else 16."""
    if latent_bits != AUTO:
        return (latent_bits,)
    return LATENT_BITS if searchable else (16,)


def group_choices(latent_group: int | None, widths: tuple[int, ...]) -> tuple[int, ...]:
    """The group sizes to plan: the one asked, else both of ``LATENT_GROUPS`` where the bit
    width is searched, else the first."""
    if latent_group is not None:
        return (latent_group,)
    return LATENT_GROUPS if len(widths) > 1 else LATENT_GROUPS[:1]
