"""The LoRC rank plan: per-layer bases and ranks for a requested cache fraction.

``plan_layers`` is a pure function of the layers' K/V weights, head and RoPE layout, the
options and (optionally) the second moment of the projections' input; ``plan`` gathers those
from a model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

import torch

from lorc_fx.analysis.records import AttentionBlock, RopeLayout
from lorc_fx.analysis.sharding import full_tensor, model_split

from lorc_fx.codes.integer import ChannelSplit, QuantSpec
from lorc_fx.codes.rows import RowSpec
from lorc_fx.codes.vector import VectorBook

from . import allocation as _water_filling  # noqa: F401  (registers its schedules)
from .metrics import relative
from .options import SCALE_BITS, STORED_FLOAT_BITS, Budget, PlanOptions
from .schedules import SCHEDULES, ScheduleInput, UnreachableFraction
from .scheme import LOW_RANK, PLAIN, Scheme, scheme_named
from .spectra import (Spectrum, block_diagonal, condition_number, real_spectrum,
                      rope_commuting_spectrum)

# a side stored as vector codes pays for each sequence's first token in full precision (the
# sink, ``cache.stores.vector``) as if sequences were this long: at 512 tokens or more the
# cache holds at most the plan's bits per value
SINK_SEQUENCE = 512

# How one side of a layer is stored: integer codes in groups (one width, or runs of widths
# over its channels), product vector codes, or ``None``: in the model's dtype
Code = QuantSpec | ChannelSplit | VectorBook | RowSpec | None


def code_bits(code: Code, rows: int, float_bits: int) -> float:
    """Bits a token of a side of ``rows`` values takes stored as ``code``, everything
    counted: integer codes with a 16-bit scale and zero point (``SCALE_BITS``) per group of
    ``group`` (exact for whole groups: the last, partial group sits in the full-precision
    window), vector codes (no scales) with their rows of floats
    (:func:`vector_exact_share`), row codes with an 8-bit exponent per group (a
    model's own cache layer: ``cache.own_layers``), floats at ``float_bits``."""
    if code is None:
        return rows * float_bits
    if isinstance(code, VectorBook):
        return sum(c * b for c, b in code.spec.runs) + rows * float_bits * vector_exact_share(
            code.drift_chunk, code.recent_divisor)
    if isinstance(code, RowSpec):
        return rows * code.bits_per_value()
    runs = code.parts if isinstance(code, ChannelSplit) else ((rows, code.bits),)
    return sum(c * (b + 2 * SCALE_BITS / code.group) for c, b in runs)


def vector_exact_share(drift_chunk: int, recent_divisor: int) -> float:
    """Rows of floats a vector-coded side holds per token besides its codes: the sink at
    ``SINK_SEQUENCE`` tokens a sequence, a drift offset each ``drift_chunk`` tokens and the
    recent window's ``1 / recent_divisor`` (0: none; exact for whole blocks of 8 tokens: the
    partial block is not counted)."""
    return (1 / SINK_SEQUENCE + (1 / drift_chunk if drift_chunk else 0)
            + (1 / recent_divisor if recent_divisor else 0))


def code_json(code: Code) -> dict | None:
    """``code`` as JSON, its tensors (a vector book's tables) left out."""
    if code is None:
        return None
    if isinstance(code, VectorBook):
        return {"vector_runs": [list(r) for r in code.spec.runs],
                "tuple_dims": code.spec.tuple_dims, "drift_chunk": code.drift_chunk,
                "recent_divisor": code.recent_divisor}
    if isinstance(code, ChannelSplit):
        return {"bit_runs": [list(r) for r in code.parts], "group": code.group}
    if isinstance(code, RowSpec):
        return {"bits": code.bits, "group": code.group, "rows": True}
    return {"bits": code.bits, "group": code.group, "axis": code.axis}


def scale_dtype(dtype_bits: int) -> torch.dtype | None:
    """What quantization scales and zero points are stored in for a model whose floats have
    ``dtype_bits`` bits: 16 bits (``SCALE_BITS``), the model's own dtype where it has 16 bits
    (``None``), else float16."""
    return None if dtype_bits == SCALE_BITS else torch.float16


@dataclass
class LayerInput:
    """What the plan needs to know about one attention layer."""

    layer: int
    # (num_kv_heads * head_dim, D), nn.Linear layout; None for a layer the analysis declined,
    # known by what its cache holds alone (``cache_layer_input``: plain plans only)
    k_weight: torch.Tensor | None
    v_weight: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeLayout
    compress_k: bool = True
    compress_v: bool = True
    note: str = ""  # why something stays full
    keys_after_rope: bool = False  # the key latent is of post-RoPE keys even in a reconstruct plan
    input_gram: torch.Tensor | None = None  # E[x xᵀ] of the K/V projection input
    # precomputed spectra (data-aware bases); energies in one error unit across projections
    k_spectrum: Spectrum | None = None
    v_spectrum: Spectrum | None = None
    shards: int = 1  # bases block-diagonal over this many equal groups of KV heads
    # transformers builds its own cache layer here (linear attention, ...): it stays as built
    kept_as_built: bool = False
    # a sliding-window (or chunked) layer of this many tokens (``cache.LatentSlidingLayer``):
    # plain codes or latents store it, not vector codes (a ring holds no sink nor blocks),
    # nor keys before RoPE (a window's rebuilt keys would need its own RoPE angle log)
    sliding_window: int | None = None
    sliding_kind: str = ""  # its layer type (``sliding_attention``, ``chunked_attention``)
    # without weights (a declined layer): the widths its cache holds, and the value head dim
    # where it is not ``head_dim`` (MLA: keys of nope + rope dims, values of their own)
    widths: tuple[int, int] | None = None
    v_head_dim: int | None = None
    # a cache layer class of the model's own (``cache.own_layers``): its every state coded as
    # rows, the same code for both sides (plain plans only)
    own_layer: str = ""

    @property
    def from_graph(self) -> bool:
        """Whether the analysis proved this layer (its K/V weights are known)."""
        return self.k_weight is not None

    @property
    def k_width(self) -> int:
        return self.k_weight.shape[0] if self.from_graph else self.widths[0]

    @property
    def v_width(self) -> int:
        return self.v_weight.shape[0] if self.from_graph else self.widths[1]

    @property
    def dtype_bits(self) -> int:
        """Bits of the model's floats, read off its K weight (a declined layer has none)."""
        return 8 * self.k_weight.element_size()

    @cached_property
    def kappa(self) -> tuple[float, float]:
        """Condition numbers of the K and V weights: an SVD each, once per input (the split
        search plans the same inputs many times); 1 without weights (nothing ranks them)."""
        if not self.from_graph:
            return 1.0, 1.0
        return condition_number(self.k_weight), condition_number(self.v_weight)


def cache_layer_input(layer: int, num_heads: int, num_kv_heads: int, k_head_dim: int,
                      v_head_dim: int, why: str, sliding: tuple[str, int] | None = None,
                      own_layer: str = "") -> LayerInput:
    """A layer the analysis declined (``why``), known by the keys and values its cache holds
    alone (``num_kv_heads`` heads of ``k_head_dim`` / ``v_head_dim`` dims): only a plain plan
    stores it (codes of what the cache receives need no proof of how it was computed), its
    note says why nothing else does. ``sliding``: (layer type, window) of a sliding layer;
    ``own_layer``: the name of the model's own cache layer class there, whose states are coded
    as rows."""
    kind, window = sliding if sliding is not None else ("", None)
    return LayerInput(
        layer=layer, k_weight=None, v_weight=None, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=k_head_dim, rope=RopeLayout(), compress_k=False,
        compress_v=False, note=f"plain codes only, no low rank: {why}", own_layer=own_layer,
        widths=(num_kv_heads * k_head_dim, num_kv_heads * v_head_dim),
        v_head_dim=None if v_head_dim == k_head_dim else v_head_dim,
        sliding_window=window, sliding_kind=kind)


def _whole_weight(block: AttentionBlock, role: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The projection's rows of every shard, shard by shard (each in this process's row
    order), from the whole weight: a tensor-parallel block's rows are its own shard's."""
    projection = getattr(block, role)
    if block.sharding is None:
        return projection.weight_tensor(params).detach()
    whole = full_tensor(params[projection.weight]).detach()  # collective, in block order
    whole = whole.t() if projection.transposed else whole
    per_shard = whole.shape[0] // block.sharding.count
    rows = [s * per_shard + r for s in range(block.sharding.count)
            for r in projection.row_index()]
    return whole[torch.tensor(rows, device=whole.device)]


def _checked_weight(block: AttentionBlock, role: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
    projection = getattr(block, role)
    weight = _whole_weight(block, role, params)
    if not weight.is_floating_point():
        raise ValueError(f"layer {block.layer}: {role.upper()} projection weight "
                         f"{projection.weight!r} has dtype {weight.dtype}; LoRC needs floating-point "
                         "weights (dequantize the model first)")
    if weight.device.type == "meta":
        raise ValueError(f"layer {block.layer}: {role.upper()} projection weight "
                         f"{projection.weight!r} is on the meta device; load the weights first")
    return weight.cpu()  # the plan's linear algebra runs on the CPU, beside the calibration's


def _shard_count(block: AttentionBlock, shards: int) -> int:
    """How many shards a block's (local) heads are of the whole layer's; ``shards`` must be
    the tensor-parallel split where there is one, and divide the KV heads otherwise."""
    if block.sharding is not None:
        if shards != block.sharding.count:
            raise ValueError(f"shards={shards}, but layer {block.layer} is split over "
                             f"{block.sharding.count} tensor-parallel processes; the plan's "
                             "shards must be that split")
        return block.sharding.count
    if block.num_kv_heads % shards:
        raise ValueError(f"shards={shards} does not divide the {block.num_kv_heads} KV heads of "
                         f"layer {block.layer}; choose a divisor of them")
    return 1


def layer_inputs(params: dict[str, torch.Tensor], blocks: list[AttentionBlock],
                 shards: int = 1) -> list[LayerInput]:
    """One :class:`LayerInput` per supported block (``params``: name → tensor, as the
    blocks' projections name them); unsupported blocks are not planned. Every input is of the
    whole layer: a tensor-parallel block's K/V weights are gathered from every process (a
    collective, in block order), its heads counted over all of them. ``shards`` is the number
    of equal groups of KV heads the bases are block-diagonal over."""
    inputs = []
    for block in blocks:
        if not block.supported:
            continue
        heads_of = _shard_count(block, shards)  # the local heads are 1/heads_of of the layer's
        keys_linear = block.k_path in ("none", "rope")
        inputs.append(LayerInput(
            layer=block.layer,
            k_weight=_checked_weight(block, "k", params),
            v_weight=_checked_weight(block, "v", params),
            num_heads=block.num_heads * heads_of, num_kv_heads=block.num_kv_heads * heads_of,
            head_dim=block.head_dim, rope=block.rope_k, shards=shards,
            compress_k=keys_linear, compress_v=block.v_path == "none",
            note="" if keys_linear else f"keys kept full: {block.k_path} between projection and cache",
        ))
    return inputs


@dataclass
class LayerPlan:
    layer: int
    k_full: int
    v_full: int
    k_rank: int
    v_rank: int
    skipped: bool
    kappa_k: float
    kappa_v: float
    log_kappa_cum: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeLayout
    k_latent_of: str  # "post_rope" keys (commute / no RoPE) or "pre_rope" keys (reconstruct)
    k_basis: torch.Tensor = field(repr=False)  # (k_rank, k_full) latent rows P, float64
    v_basis: torch.Tensor = field(repr=False)
    k_rebuild: torch.Tensor = field(repr=False)  # (k_rank, k_full) rows B: keys ≈ Bᵀ·(P·keys)
    v_rebuild: torch.Tensor = field(repr=False)
    k_energy_kept: float = 1.0  # share of the spectrum's energy the basis keeps
    v_energy_kept: float = 1.0
    k_compressible: bool = True  # False: keys stay raw (e.g. a norm between projection and cache)
    v_compressible: bool = True
    note: str = ""
    # how each side's latent (its basis rows in order; raw keys or values where not
    # compressible) is stored (``Code``); None: in the model's dtype
    k_code: Code = field(default=None, repr=False)
    v_code: Code = field(default=None, repr=False)

    @property
    def compressed(self) -> bool:
        return self.k_rank < self.k_full or self.v_rank < self.v_full

    def summary(self) -> dict:
        keys = ("layer", "k_rank", "v_rank", "k_full", "v_full", "skipped", "kappa_k",
                "kappa_v", "log_kappa_cum", "k_latent_of", "k_energy_kept", "v_energy_kept",
                "note")
        out = {k: getattr(self, k) for k in keys}
        out.update(k_code=code_json(self.k_code), v_code=code_json(self.v_code),
                   rope=asdict(self.rope))
        return out


def _low_rank() -> Scheme:
    return scheme_named(LOW_RANK)


# an attribute ``cache.install`` sets on every parameter of a model it installs a plan on:
# lorc_backend then leaves that model's attention to the plan (compile.passes.compress_attention)
PLANNED = "_lorc_planned"


@dataclass
class Plan:
    layers: list[LayerPlan]
    options: PlanOptions
    reachable: tuple[float, float]

    rotary_log: int = 0  # elements per token of the RoPE angles a reconstruct-mode cache keeps
    # the model planned (``plan_file.plan_fingerprint``, and its name): set by
    # ``lorc_fx.plan``, saved with the plan and checked where a saved plan is installed
    fingerprint: str | None = None
    model_name: str | None = None
    # why the basis is the weight-only one, where it is (``bases.resolve``); the report shows it
    basis_note: str = ""
    # with ``max_ppl_increase``: the target, the fraction chosen and the held-out perplexity
    # ratio measured per fraction tried (``lorc_fx.search.fraction.FractionSearch.to_json``)
    fraction_search: dict | None = None
    dtype_bits: int = 16  # bits of the model's floats: what the cache stores unquantized
    # the storage scheme that made the plan (``lorc_fx.schemes``); what each side stores is
    # its layers' codes
    scheme: Scheme = field(default_factory=_low_rank)
    # the candidates the search measured (``lorc_fx.search.candidates``), best first
    candidates: list[dict] = field(default_factory=list)
    # the shard of ``options.shards`` this plan is (``local``): its layers cover that shard's
    # KV heads only; None: the whole model
    shard: int | None = None
    # why nothing was measured: the analysis declined the attention, so a plain plan was
    # chosen by bits alone (``schemes.plain.plan_without_graph``); "" for a searched plan
    unproven: str = ""

    @property
    def budget(self) -> Budget:
        return self.options.budget

    @property
    def shards(self) -> int:
        return self.options.shards or 1

    def local(self, index: int) -> "Plan":
        """The plan of shard ``index`` of ``options.shards``: each layer's rows of that shard
        (every ``shards``-th row of a block-diagonal basis) on its own KV heads' dims, which
        is what the process holding those heads caches. Identity for an unsharded plan."""
        count = self.shards
        if count == 1:
            return self
        if not self.scheme.capabilities.shards:
            raise ValueError(f"a {self.scheme.title} plan cannot be split over shards; plan "
                             "with shards=1")
        if self.shard is not None or not 0 <= index < count:
            raise ValueError(f"shard index must be in [0, {count}) of a whole-model plan, "
                             f"got {index}")
        interleaved = not self.scheme.identity_bases
        return replace(self, layers=[_local_layer(l, index, count, interleaved)
                                     for l in self.layers], shard=index)

    @property
    def cache_fraction(self) -> float:
        """Cache bytes kept ÷ the uncompressed cache's bytes, in the model's dtype."""
        full, _ = self.cache_elements_per_token()
        return self.bits_per_token(self.dtype_bits) / (full * self.dtype_bits)

    @property
    def bits_per_value(self) -> float:
        """Bits per cached K/V value, every stored float at 16 bits (16: uncompressed)."""
        full, _ = self.cache_elements_per_token()
        return self.bits_per_token(STORED_FLOAT_BITS) / full

    def cache_elements_per_token(self) -> tuple[int, int]:
        """(full, compressed) elements the cache holds per token, all layers: K+V, or
        latents plus the RoPE angle log."""
        full = sum(l.k_full + l.v_full for l in self.layers)
        return full, sum(l.k_rank + l.v_rank for l in self.layers) + self.rotary_log

    @property
    def coded(self) -> bool:
        """Whether any side is stored as codes (else every value in the model's dtype)."""
        return any(l.k_code is not None or l.v_code is not None for l in self.layers)

    def bits_per_token(self, float_bits: int) -> float:
        """Bits the cache holds per token per sequence where a stored float has
        ``float_bits`` bits: every side as its code says (``code_bits``) and the RoPE angle
        log."""
        return self.rotary_log * float_bits + sum(
            code_bits(l.k_code, l.k_rank, float_bits) + code_bits(l.v_code, l.v_rank, float_bits)
            for l in self.layers)

    def cache_bytes_per_token(self, dtype_bytes: int) -> tuple[int, float]:
        """(full, compressed) cache bytes per token per sequence for a model whose dtype has
        ``dtype_bytes`` bytes, everything counted (``bits_per_token``). The compressed figure
        is an int when nothing is stored as codes."""
        full, kept = self.cache_elements_per_token()
        if not self.coded:
            return full * dtype_bytes, kept * dtype_bytes
        return full * dtype_bytes, self.bits_per_token(8 * dtype_bytes) / 8

    @property
    def latent_budget(self) -> float:
        """The share of the full K/V width the budget leaves to the schedule (latents and the
        sides kept full)."""
        full, _ = self.cache_elements_per_token()
        fixed = sum((l.k_full if l.skipped or not l.k_compressible else 0)
                    + (l.v_full if l.skipped or not l.v_compressible else 0) for l in self.layers)
        return element_budget(self.options, full, fixed, self.rotary_log, self.dtype_bits)

    def to_json(self) -> dict:
        budget = self.budget
        return {
            "cache_fraction": self.cache_fraction,
            "bits_per_value": self.bits_per_value,
            "requested_fraction": None if budget.in_bits else budget.value,
            "requested_bits_per_value": budget.value if budget.in_bits else None,
            "reachable": list(self.reachable),
            "kind": self.scheme.name,
            "options": asdict(self.options),
            "basis_note": self.basis_note, "shard": self.shard, "unproven": self.unproven,
            "fraction_search": self.fraction_search,
            "candidates": self.candidates,
            "layers": [l.summary() for l in self.layers],
            "model": self.model_name, "fingerprint": self.fingerprint,
        }


def process_plan(plan: Plan, blocks: list[AttentionBlock]) -> Plan:
    """What this process caches of ``plan``: the plan of its own shard where the blocks are
    split over tensor-parallel processes, else the whole plan."""
    split = model_split(blocks)
    return plan if split is None else plan.local(split.index)


def _local_layer(layer: LayerPlan, index: int, count: int, interleaved: bool) -> LayerPlan:
    """Shard ``index`` of ``count`` of a whole-model layer plan. A block-diagonal basis
    (``spectra.block_diagonal``) interleaves its shards' rows (row ``j·count + s`` is shard
    ``s``'s ``j``-th); a plain plan's identity keeps them in the dims' own order, so its shard
    is the identity again and its codes group exactly as the whole model's do."""
    k_w, v_w = layer.k_full // count, layer.v_full // count

    def rows(t: torch.Tensor, w: int) -> torch.Tensor:
        own = t[index::count] if interleaved else t[index * w:(index + 1) * w]
        return own[:, index * w:(index + 1) * w]

    return replace(layer, k_full=k_w, v_full=v_w, k_rank=layer.k_rank // count,
                   v_rank=layer.v_rank // count, num_heads=layer.num_heads // count,
                   num_kv_heads=layer.num_kv_heads // count,
                   k_basis=rows(layer.k_basis, k_w), v_basis=rows(layer.v_basis, v_w),
                   k_rebuild=rows(layer.k_rebuild, k_w), v_rebuild=rows(layer.v_rebuild, v_w))


def own_layer_note(kind: str, code: RowSpec, why: str) -> str:
    """A layer plan's note for a model's own cache layer class, its states coded as rows."""
    return (f"its own cache layer ({kind}): every state it holds stored as {code.bits}-bit "
            f"rows, a power-of-two scale per {code.group} values; {why}")


def value_token_group(head_dim: int, group: int) -> int:
    """Channels per scale of values quantized per token: ``group`` where it divides the head
    dim, else the whole head (a group never spans two heads)."""
    return group if head_dim % group == 0 else head_dim


def element_budget(options: PlanOptions, full: int, fixed: int, rotary_log: int,
                   dtype_bits: int) -> float:
    """The share of the ``full`` K/V width the schedule may keep (``fixed`` of it is sides
    kept full) so that the cache meets ``options``' budget (``Budget.bits``): the RoPE angle
    log and the fixed sides cost a stored float per element, latents
    ``latent_bits_per_value``. The whole budget (``Budget.whole``) keeps every dim, the angle
    log beside them; a budget beyond full-width latents (quantized) is capped at 1."""
    if options.budget.whole:
        return 1.0
    budget, float_bits = options.budget.bits(dtype_bits)
    latent_bits = options.latent_bits_per_value(float_bits)
    latents = (budget * full - (rotary_log + fixed) * float_bits) / latent_bits
    return min(1.0, (latents + fixed) / full)


def _energy_kept(spectrum: Spectrum, rank: int) -> float:
    total = float(spectrum.energy.sum())
    return 1.0 - spectrum.dropped_energy(rank) / total if total > 0 else 1.0


def _per_shard(layer: LayerInput, weight: torch.Tensor, spectrum_of) -> Spectrum:
    """``spectrum_of(rows, kv_heads)`` of the weight, or with ``layer.shards`` > 1 the
    block-diagonal spectrum of each shard's rows (its KV heads) alone; energies as shares
    of the total (the one unit in which weight spectra compare)."""
    if layer.shards == 1:
        return relative(spectrum_of(weight, layer.num_kv_heads))
    rows = weight.shape[0] // layer.shards
    return relative(block_diagonal([spectrum_of(weight[s * rows:(s + 1) * rows],
                                                layer.num_kv_heads // layer.shards)
                                    for s in range(layer.shards)]))


def _precomputed(layer: LayerInput, spectrum: Spectrum | None, side: str) -> Spectrum | None:
    if spectrum is not None and layer.shards > 1:
        raise ValueError(f"layer {layer.layer}: the {side} spectrum the basis measured spans "
                         f"every KV head, not one shard of {layer.shards}; use basis='whitened', "
                         "'norm' or 'weight' with shards > 1")
    return spectrum


def _key_spectrum(layer: LayerInput, options: PlanOptions) -> Spectrum:
    """The layer's precomputed key spectrum, else the weight's under the input metric
    (per shard where the plan has shards), RoPE-commuting where ``options`` asks it."""
    given = _precomputed(layer, layer.k_spectrum, "key")
    if given is not None:
        return given
    if layer.rope.style != "none" and options.rope_commuting_keys:
        return _per_shard(layer, layer.k_weight, lambda w, heads: rope_commuting_spectrum(
            w, heads, layer.head_dim, layer.rope, layer.input_gram))
    return _per_shard(layer, layer.k_weight, lambda w, heads: real_spectrum(w, layer.input_gram))


def _value_spectrum(layer: LayerInput) -> Spectrum:
    given = _precomputed(layer, layer.v_spectrum, "value")
    if given is not None:
        return given
    return _per_shard(layer, layer.v_weight, lambda w, heads: real_spectrum(w, layer.input_gram))


def key_energies(layers: list[LayerInput], options: PlanOptions) -> list[torch.Tensor]:
    """Each layer's key spectrum energies under ``options``' RoPE mode: the error of dropping
    each row of the basis ``plan_layers`` gives it, in one unit across layers."""
    return [_key_spectrum(l, options).energy for l in layers]


def value_energies(layers: list[LayerInput]) -> list[torch.Tensor]:
    """Each layer's value spectrum energies: the error of dropping each row of its basis."""
    return [_value_spectrum(l).energy for l in layers]


def cumulative_log_kappa(kappa_k: list[float], kappa_v: list[float]) -> list[float]:
    """log κ̃_l = Σ_{j ≥ l} log κ(W_k^j) + log κ(W_v^j), in log space so it cannot overflow."""
    logs = [math.log(k) + math.log(v) for k, v in zip(kappa_k, kappa_v)]
    out, acc = [], 0.0
    for value in reversed(logs):
        acc += value
        out.append(acc)
    return out[::-1]


def _key_latent_of(layer: LayerInput, options: PlanOptions) -> str:
    """``pre_rope`` where a reconstruct plan caches this layer's keys before RoPE; keys
    stored raw, and keys whose basis is of post-RoPE keys, are ``post_rope``."""
    pre = (options.rope == "reconstruct" and layer.rope.style != "none" and layer.compress_k
           and not layer.keys_after_rope)
    return "pre_rope" if pre else "post_rope"


def angle_log_width(rotary_dim: int) -> int:
    """Values per token the RoPE angle log keeps for ``rotary_dim`` rotated head dims
    (``cache.rotary.RotaryLog``: an angle per rotary pair and one magnitude)."""
    return rotary_dim // 2 + 1


def _rotary_log(layers: list[LayerInput], compress_k: list[bool], options: PlanOptions) -> int:
    """Elements per token of the RoPE angles a cache keeps once for all its pre-RoPE latents."""
    dims = [l.rope.rotary_dim for l, c in zip(layers, compress_k)
            if c and _key_latent_of(l, options) == "pre_rope"]
    return angle_log_width(max(dims)) if dims else 0


def budget_reached(options: PlanOptions, kept: float, full: int, fixed: int, rotary_log: int,
                   dtype_bits: int) -> float:
    """The budget, in the unit ``options`` asks in (cache fraction, or bits per value), of a
    schedule keeping ``kept`` of the full width (``fixed`` of it full sides)."""
    _, float_bits = options.budget.bits(dtype_bits)
    latents = kept * full - fixed
    bits = (latents * options.latent_bits_per_value(float_bits)
            + (fixed + rotary_log) * float_bits) / full
    return options.budget.of_bits(bits, dtype_bits)


def _unreachable(err: UnreachableFraction, options: PlanOptions, lowest: float
                 ) -> UnreachableFraction:
    """The schedule's refusal said in the unit of the request."""
    budget = options.budget
    return UnreachableFraction(
        f"{budget} is out of reach of the {options.schedule} schedule on this model with "
        f"{options.latent_bits}-bit latents: it reaches [{lowest:.3f}, {budget.top:g}] "
        f"({budget.unit}, the skipped layers kept); ask for a budget in that range, fewer "
        "latent bits, or another schedule", lowest)


def plan_layers(layers: list[LayerInput], options: PlanOptions,
                dtype_bits: int | None = None) -> Plan:
    """Bases and ranks for every layer, latents stored at ``options.latent_bits`` (pure;
    deterministic): the low-rank scheme's plan, and the full-rank plan other schemes start
    from. "auto" options are taken at their first choice (``PlanOptions.concrete``).
    ``dtype_bits``: bits of the model's floats, what the cache stores unquantized (default:
    the K weight's)."""
    options = options.concrete()
    if not layers:
        raise ValueError("no attention layer to plan: the analysis found no supported "
                         "attention block (lorc_fx.analyze(model) says why)")
    widest = max(max(l.k_weight.shape[0], l.v_weight.shape[0]) for l in layers)
    if options.rank_multiple > widest:
        raise ValueError(f"rank_multiple={options.rank_multiple} is wider than every key/value "
                         f"projection of this model ({widest}); choose 1..{widest}")
    kappa_k, kappa_v = zip(*(l.kappa for l in layers))
    log_cum = cumulative_log_kappa(kappa_k, kappa_v)
    skipped = [
        i < options.keep_first
        or (options.skip_threshold is not None and lk > math.log(max(options.skip_threshold, 1e-300)))
        for i, lk in enumerate(log_cum)
    ]
    k_spectra = [_key_spectrum(l, options) for l in layers]
    v_spectra = [_value_spectrum(l) for l in layers]
    compress_k = [l.compress_k and not s for l, s in zip(layers, skipped)]
    rotary_log = _rotary_log(layers, compress_k, options)
    compress_v = [l.compress_v and not s for l, s in zip(layers, skipped)]
    if dtype_bits is None:
        dtype_bits = 8 * layers[0].k_weight.element_size()
    full = sum(k.width + v.width for k, v in zip(k_spectra, v_spectra))
    fixed = sum((0 if ck else k.width) + (0 if cv else v.width)
                for k, v, ck, cv in zip(k_spectra, v_spectra, compress_k, compress_v))
    latent = element_budget(options, full, fixed, rotary_log, dtype_bits)
    reached = lambda kept: budget_reached(options, kept, full, fixed, rotary_log, dtype_bits)
    # what the messages of an unquantized plan asked in cache fraction add to the latents
    legacy = not options.budget.in_bits and options.latent_bits == 16
    overhead = options.budget.value - latent if legacy else 0.0
    inp = ScheduleInput(
        k_spectra=k_spectra, v_spectra=v_spectra, log_kappa_cum=log_cum, compress_k=compress_k,
        compress_v=compress_v, cache_fraction=latent, rank_multiple=options.rank_multiple,
        key_fraction=options.key_fraction, overhead_fraction=overhead,
        allow_zero_rank=options.allow_zero_rank)
    try:
        allocation = SCHEDULES[options.schedule](inp)
    except UnreachableFraction as err:
        if legacy:
            raise
        raise _unreachable(err, options, reached(err.lowest)) from None

    plans = []
    for l, ks, vs, (kr, vr), s, kk, kv, lk in zip(layers, k_spectra, v_spectra, allocation.ranks, skipped,
                                                  kappa_k, kappa_v, log_cum):
        plans.append(LayerPlan(
            layer=l.layer, k_full=ks.width, v_full=vs.width, k_rank=kr, v_rank=vr, skipped=s,
            kappa_k=kk, kappa_v=kv, log_kappa_cum=lk, num_heads=l.num_heads,
            num_kv_heads=l.num_kv_heads, head_dim=l.head_dim, rope=l.rope,
            k_latent_of=_key_latent_of(l, options),
            k_basis=ks.basis(kr), v_basis=vs.basis(vr),
            k_rebuild=ks.rebuild(kr), v_rebuild=vs.rebuild(vr),
            k_energy_kept=_energy_kept(ks, kr), v_energy_kept=_energy_kept(vs, vr),
            k_compressible=l.compress_k, v_compressible=l.compress_v, note=l.note,
            k_code=latent_code(options, dtype_bits, l.compress_k and not s, kr),
            v_code=latent_code(options, dtype_bits, l.compress_v and not s, vr)))
    return Plan(plans, options, (reached(allocation.lowest_fraction), options.budget.top),
                rotary_log, dtype_bits=dtype_bits)


def latent_code(options: PlanOptions, dtype_bits: int, compressed: bool, rank: int) -> Code:
    """How a low-rank plan stores a side's latent: ``latent_bits`` codes per channel over
    groups of ``latent_group`` tokens (one scale and zero point per channel and group, which
    follow the channels' very different ranges), where the side is compressed and keeps a
    latent; else in the model's dtype."""
    if options.latent_bits == 16 or not compressed or not rank:
        return None
    return QuantSpec.per_channel(options.latent_bits, options.latent_group,
                                 scale_dtype(dtype_bits))


def sliding_note(kind: str, window: int, code: str | None = None) -> str:
    """What a sliding-window layer of ``window`` tokens holds, for its plan's note; ``code``
    says how its keys and values are coded where the note must say it."""
    held = f"{kind}, a window of {window} tokens: holds its last {window - 1}"
    return f"{held}, {code} (codes dropped in whole groups as they leave it)" if code else held


def without_sliding_latents(inputs: list[LayerInput]) -> list[LayerInput]:
    """``inputs`` with the sides of sliding-window layers not compressible: for a scheme whose
    codes a ring buffer cannot hold (vector codes), which :func:`sliding_coded` then codes."""
    return [replace(l, compress_k=False, compress_v=False, keys_after_rope=False)
            if l.sliding_window and not l.kept_as_built else l for l in inputs]


def plain_codes(layer: LayerInput, bits: int, group: int, dtype_bits: int) -> tuple[Code, Code]:
    """How plain KV quantization stores ``layer``'s keys and values at ``bits``: keys per
    channel over groups of ``group`` tokens, values per token over groups of channels within
    each head (KIVI's layout), each group's scale and zero point in the model's dtype."""
    scales = scale_dtype(dtype_bits)
    return (QuantSpec.per_channel(bits, group, scales),
            QuantSpec.per_token(bits, value_token_group(layer.v_head_dim or layer.head_dim,
                                                        group), scales))


def sliding_coded(plan: Plan, layers: list[LayerInput], bits: int, group: int) -> Plan:
    """``plan`` with the keys and values of its sliding-window (or chunked) layers, which
    only plain codes store (their ring buffers hold per-group codes), stored as plain
    ``bits``-bit codes in groups of ``group`` where they were kept full: a scheme whose own
    codes cannot store them so leaves the rest of its budget to the other layers."""
    window = {l.layer: l for l in layers if l.sliding_window and not l.kept_as_built}
    coded = []
    for l in plan.layers:
        held = window.get(l.layer)
        if held is None or l.skipped or l.k_compressible or l.v_compressible \
                or l.k_code is not None or l.v_code is not None:
            coded.append(l)
            continue
        k_code, v_code = plain_codes(held, bits, group, plan.dtype_bits)
        coded.append(replace(l, k_code=k_code, v_code=v_code, note=sliding_note(
            held.sliding_kind, held.sliding_window, f"its keys and values as {bits}-bit plain "
            f"codes, G{group}")))
    return replace(plan, layers=coded)


def plain_quantized_plan(layers: list[LayerInput], options: PlanOptions,
                         dtype_bits: int | None = None) -> Plan:
    """Plain KV-cache quantization as a plan of the ``plain`` scheme: every layer at full
    width with identity bases (not applied: ``Scheme.identity_bases``), and the cache stores
    the keys (after any norm and RoPE) and values themselves as ``options.latent_bits``-bit
    codes, keys per channel over groups of ``latent_group`` tokens and values per token over
    groups of channels within each head (KIVI's layout). Sliding-window layers are coded
    alike (their bytes per token counted as a full layer's: what they hold while the context
    is within the window); other layers transformers builds its own cache layer for stay as
    built (``skipped``)."""
    options = options.concrete()
    if options.latent_bits == 16:
        raise ValueError("a plain quantized plan needs latent_bits 8 or 4")
    if dtype_bits is None:
        dtype_bits = 8 * layers[0].k_weight.element_size()
    options = replace(options, rope="commute")
    bits, group = options.latent_bits, options.latent_group
    kappa_k, kappa_v = zip(*(l.kappa for l in layers))
    plans = []
    for l, kk, kv, lk in zip(layers, kappa_k, kappa_v, cumulative_log_kappa(kappa_k, kappa_v)):
        k_eye = torch.eye(l.k_width, dtype=torch.float64)
        v_eye = torch.eye(l.v_width, dtype=torch.float64)
        kept = not l.kept_as_built
        sliding = (sliding_note(l.sliding_kind, l.sliding_window, "coded as the other layers")
                   if l.sliding_window else "")
        note = (l.note if l.kept_as_built or not l.from_graph and not sliding
                else f"{sliding}; {l.note}" if not l.from_graph else sliding)
        if l.own_layer:  # every state of the layer coded alike
            k_code = v_code = RowSpec(bits, value_token_group(l.head_dim, group))
            note = own_layer_note(l.own_layer, k_code, l.note)
        elif kept:
            k_code, v_code = plain_codes(l, bits, group, dtype_bits)
        else:
            k_code = v_code = None
        plans.append(LayerPlan(
            layer=l.layer, k_full=len(k_eye), v_full=len(v_eye), k_rank=len(k_eye),
            v_rank=len(v_eye), skipped=l.kept_as_built, kappa_k=kk, kappa_v=kv,
            log_kappa_cum=lk, num_heads=l.num_heads, num_kv_heads=l.num_kv_heads,
            head_dim=l.head_dim, rope=l.rope, k_latent_of="post_rope", k_basis=k_eye,
            v_basis=v_eye, k_rebuild=k_eye, v_rebuild=v_eye,
            note=note, k_code=k_code, v_code=v_code))
    plan = Plan(plans, options, (0.0, 0.0), 0, dtype_bits=dtype_bits,
                scheme=scheme_named(PLAIN))
    size = options.budget.of(plan)
    plan.reachable = (size, size)
    return plan
