"""A storage scheme: one way to store the cache (plain quantization, low rank, ...), as an
object every stage asks instead of switching on a name.

A :class:`Scheme` offers the search its candidates for a budget, says in words what a plan
of it stores (the report), and declares what a plan of it can do (:class:`Capabilities`:
static cache, compiled decode, tensor-parallel shards). What a plan stores per side is not
the scheme's to say again: each layer's sides carry their codes (``LayerPlan.k_code``:
integer groups, runs of widths, vector codes, or none), which give the plan's bits, the
cache's stores and the plan file's contents, whatever scheme chose them.

The schemes live above every stage they use (``lorc_fx.schemes``: one module each) and
register themselves here, so a :class:`~lorc_fx.plan.planner.Plan` holds its scheme as an
object and a plan file names it; ``lorc_fx`` imports them all, as ``register`` calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from lorc_fx.search.context import Candidate, SearchContext

    from .planner import Plan

# the schemes of the planner's own plans (``planner.plan_layers``, ``plain_quantized_plan``)
LOW_RANK, PLAIN = "low_rank", "plain"


class Capabilities(NamedTuple):
    static_cache: bool  # generate(cache_implementation="static") and latent_cache(max_len)
    compiled_decode: bool  # a decode step compiles into one graph (no break at the codes)
    shards: bool  # planned over tensor-parallel shards of the KV heads


class Scheme(ABC):
    """One storage scheme. Subclasses set ``name`` (what plan files record), ``title`` (what
    reports call it) and ``capabilities``."""

    name: str
    title: str
    capabilities: Capabilities
    # the cache stores keys and values themselves: the plan's identity bases are not applied,
    # and a shard's rows are its own heads' dims, in order
    identity_bases: bool = False

    @abstractmethod
    def candidates(self, search: SearchContext) -> list[Candidate]:
        """The plans this scheme offers for ``search``'s budget, cheapest to measure first
        (each built and measured only when the search reaches it)."""

    @abstractmethod
    def how(self, plan: Plan) -> str:
        """How ``plan`` was made, in a phrase (the report's size line)."""

    @abstractmethod
    def summary(self, plan: Plan) -> str:
        """What ``plan`` stores, in a phrase (a row of a results table)."""

    def describe(self, plan: Plan) -> list[str]:
        """What ``plan`` stores, in lines for the report: by default its ranks per layer."""
        return rank_table(plan)

    def limits(self) -> str:
        """What ``generate`` and ``torch.compile`` cannot do with a plan of this scheme, in a
        sentence ("" where nothing): ``install`` says it once."""
        c = self.capabilities
        said = ([] if c.static_cache else ["generate builds a dynamic cache (a static one, "
                                           "cache_implementation='static', is refused)"])
        said += [] if c.compiled_decode else [
            "torch.compile gives the same tokens without speeding decode up (dynamo breaks the "
            "graph at the codes)"]
        return "; ".join(said)


SCHEMES: dict[str, Scheme] = {}


def register(scheme: Scheme) -> Scheme:
    """Add ``scheme`` to :data:`SCHEMES` (in the order the search measures them)."""
    if scheme.name in SCHEMES:
        raise ValueError(f"a storage scheme named {scheme.name!r} is registered already")
    SCHEMES[scheme.name] = scheme
    return scheme


def scheme_named(name: str) -> Scheme:
    """The registered scheme ``name``; a ``ValueError`` listing the known ones otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown storage scheme {name!r}; this lorc_fx knows "
                         f"{sorted(SCHEMES)}") from None


def rank_table(plan: Plan, per_layer=lambda layer: "") -> list[str]:
    """The ranks of ``plan``'s layers as a table, with ``per_layer(layer)`` at each row's end."""
    header = (f"{'layer':>5} {'K rank':>9} {'V rank':>9} {'κ(W_k)':>10} {'κ(W_v)':>10} "
              f"{'log κ̃':>8}  skipped")
    lines = [header, "-" * len(header)]
    for l in plan.layers:
        lines.append(
            f"{l.layer:>5} {l.k_rank:>4}/{l.k_full:<4} {l.v_rank:>4}/{l.v_full:<4} "
            f"{l.kappa_k:>10.3g} {l.kappa_v:>10.3g} {l.log_kappa_cum:>8.2f}  "
            f"{'yes' if l.skipped else 'no'}{'  ' + l.note if l.note else ''}{per_layer(l)}")
    return lines
