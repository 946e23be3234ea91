"""What the user reads: the analysis as a table or JSON, a plan as a table or PNG, and
``compress``'s report."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lorc_fx.analysis.records import AttentionBlock, Projection, RopeLayout
from lorc_fx.plan import plan_file
from lorc_fx.plan.options import SELF_TEXT
from lorc_fx.codes.integer import ChannelSplit, QuantSpec
from lorc_fx.codes.rows import RowSpec
from lorc_fx.plan.planner import Code, LayerPlan, Plan


def plan_table(plan: Plan) -> str:
    """The plan in words: what its scheme stores (``Scheme.describe``), its size against the
    budget asked, the basis, and the candidates measured."""
    scheme = plan.scheme
    lines = scheme.describe(plan)
    lines.append(f"cache fraction: {plan.cache_fraction:.4f}, {plan.bits_per_value:.3f} bits per "
                 f"value (requested {plan.budget.asked()}; {scheme.how(plan)})")
    if not scheme.identity_bases:
        lines.append(f"basis: {basis_description(plan)}")
    if plan.fraction_search:
        lines.append(f"fraction: {fraction_description(plan.fraction_search)}")
    if plan.shards > 1 and scheme.identity_bases:
        lines.append(f"split over {plan.shards} shards of the KV heads: each quantizes and caches "
                     "its own heads' keys and values")
    elif plan.shards > 1:
        lines.append(f"bases block-diagonal over {plan.shards} shards of the KV heads (ranks are "
                     f"whole-layer figures: each shard keeps 1/{plan.shards} of them, on its own "
                     "heads)")
    if any(l.k_latent_of == "pre_rope" and not l.skipped for l in plan.layers):
        lines.append(
            "rope=reconstruct in a RoPE-commuting key basis (objective='speed'): keys are "
            "cached before RoPE and decode scores them per rotary pair, not rebuilt"
            if plan.options.rope_commuting_keys else
            "rope=reconstruct: keys are cached before RoPE and rebuilt over the whole context "
            "every decode step, so long-context decode gains less speed than the cache shrinks "
            "(bench/results/long_context_lowrank-cpu.md); objective='speed' (--objective speed) "
            "keeps them in a RoPE-commuting basis, which decode scores without rebuilding")
    lines += layer_lines(plan)
    if plan.candidates:
        lines.append("candidates measured (held-out calibration loss, best first; a loss within "
                     "0.002 of the uncompressed model's ends the search):")
        lines += [f"  {_loss(c['loss'])}  {c['bits_per_value']:6.3f} bits/value  {c['candidate']}"
                  for c in plan.candidates if "skipped" not in c]
        skipped: dict[str, list[str]] = {}
        for c in plan.candidates:
            if "skipped" in c:
                skipped.setdefault(c["skipped"], []).append(c["candidate"])
        lines += [f"  not measured ({why}): {'; '.join(names)}" for why, names in skipped.items()]
    return "\n".join(lines)


def _loss(loss: float | None) -> str:
    return "   inf" if loss is None else f"{loss:.4f}"  # None: the plan's loss overflowed


def _side(code: Code, rank: int, full: int, latent: bool) -> str:
    """What one side of a layer stores, in a few words."""
    of = f" of a {rank}-wide latent" if latent and rank < full else ""
    if rank == 0:
        return "nothing (rank 0)"
    if code is None:
        return ("in the model's dtype" + of) if of else "in the model's dtype"
    if isinstance(code, ChannelSplit):
        return "water-filled widths " + "+".join(f"{c}×{b}b" for c, b in code.parts) + of
    if isinstance(code, RowSpec):
        return f"int{code.bits} rows G{code.group}"
    if isinstance(code, QuantSpec):
        axis = "channel" if code.axis % 4 == 2 else "token"
        return f"int{code.bits} per {axis} G{code.group}{of}"
    return f"vector codes{of}"


def _layer_words(plan: Plan, l: LayerPlan) -> str:
    if l.skipped:
        return f"kept full ({l.note})" if l.note else "kept full"
    latent = not plan.scheme.identity_bases
    words = (f"keys {_side(l.k_code, l.k_rank, l.k_full, latent and l.k_compressible)}, "
             f"values {_side(l.v_code, l.v_rank, l.v_full, latent and l.v_compressible)}")
    return f"{words}; {l.note}" if l.note else words


def layer_lines(plan: Plan) -> list[str]:
    """What each layer stores, layers storing alike on one line ("layers 0-4, 6: ...")."""
    groups: dict[str, list[int]] = {}
    for l in plan.layers:
        groups.setdefault(_layer_words(plan, l), []).append(l.layer)
    lines = []
    for words, layers in groups.items():
        runs, start = [], layers[0]
        for prev, cur in zip(layers, layers[1:] + [None]):
            if cur != prev + 1:
                runs.append(str(start) if start == prev else f"{start}-{prev}")
                start = cur
        lines.append(f"layer{'s' if len(layers) > 1 else ''} {', '.join(runs)}: {words}")
    return lines


def basis_description(plan: Plan) -> str:
    """What the plan's basis was measured on, in words; the weight-only basis says why."""
    o = plan.options
    if plan.basis_note or o.basis == "weight":
        return plan.basis_note or "weight-only SVD (the paper's calibration-free basis)"
    if o.basis == "norm":
        return "norm-scaled weight SVD (no calibration)"
    c = o.calibration
    texts = " + ".join("text sampled from the model itself" if t == SELF_TEXT else repr(t)
                       for t in c.texts)
    return (f"{o.basis}, calibrated on {c.tokens} tokens ({texts}; windows of {c.window}, "
            f"seed {c.seed})")


def fraction_description(search: dict) -> str:
    """How ``max_ppl_increase`` chose the fraction, in words."""
    tried = ", ".join(f"{f} ×{r:.3f}" for f, r in search["measured"].items())
    return (f"{search['chosen_fraction']:.2f} requested, the smallest whose held-out calibration "
            f"perplexity is within ×{1 + search['max_ppl_increase']:.3g} of the full cache's "
            f"(×{search['ppl_ratio']:.4f}; tried {tried or 'none'})")


def plot_plan(plan: Plan, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [l.layer for l in plan.layers]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(layers, [l.k_rank for l in plan.layers], "o-", label="K rank")
    ax.plot(layers, [l.v_rank for l in plan.layers], "s--", label="V rank")
    ax.set_xlabel("layer")
    ax.set_ylabel("latent width")
    twin = ax.twinx()
    twin.plot(layers, [l.log_kappa_cum for l in plan.layers], color="gray", alpha=0.6,
              label="log κ̃")
    twin.set_ylabel("cumulative log condition number")
    ax.set_title(f"{plan.options.schedule} plan, cache fraction {plan.cache_fraction:.3f}")
    lines = ax.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class CompressionReport:
    """What ``lorc_fx.compress`` did; ``plan`` is None when it left the model unchanged, and
    ``left_alone`` then says why."""

    plan: Plan | None
    unsupported: list[tuple[int, str]] = field(default_factory=list)  # (layer, why)
    dtype_bytes: int = 4
    left_alone: str = ""

    def cache_bytes_per_token(self) -> tuple[int, int | float]:
        """(full, compressed) cache bytes per token per sequence, all planned layers; in
        ``reconstruct`` mode the compressed figure includes the RoPE angle log, with sides stored
        as codes their scales and zero points or sinks (``Plan.cache_bytes_per_token``: a float
        then, exact for whole groups of tokens)."""
        if self.plan is None:
            return 0, 0
        return self.plan.cache_bytes_per_token(self.dtype_bytes)

    def cache_bytes_per_token_per_shard(self) -> tuple[int, int | float]:
        """(full, compressed) cache bytes per token per sequence that each of the plan's
        ``shards`` holds (each tensor-parallel process its own KV heads' latents); with one
        shard, the whole model's."""
        if self.plan is None:
            return 0, 0
        return self.plan.local(0).cache_bytes_per_token(self.dtype_bytes)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan to ``path`` (``lorc_fx.save_plan``); ``compress(model, plan=path)``
        installs it again without planning. Returns the file written."""
        return plan_file.save_plan(self.plan, path)

    def to_json(self) -> dict:
        full, kept = self.cache_bytes_per_token()
        shard_full, shard_kept = self.cache_bytes_per_token_per_shard()
        plan = self.plan.to_json() if self.plan is not None else {"left_alone": self.left_alone}
        return {**plan, "cache_bytes_per_token_full": full,
                "cache_bytes_per_token_compressed": kept,
                "cache_bytes_per_token_per_shard_full": shard_full,
                "cache_bytes_per_token_per_shard_compressed": shard_kept,
                "unsupported": [{"layer": l, "reason": r} for l, r in self.unsupported]}

    def __str__(self) -> str:
        if self.plan is None:
            lines = [f"model left unchanged: {self.left_alone}"]
        else:
            full, kept = self.cache_bytes_per_token()
            lines = [plan_table(self.plan),
                     f"cache bytes per token: {full} full, {kept:g} compressed "
                     f"({kept / full:.3f})"]
            shards = self.plan.shards
            if shards > 1:
                shard_full, shard_kept = self.cache_bytes_per_token_per_shard()
                lines.append(f"  per shard (each of {shards} tensor-parallel processes caches "
                             f"its own KV heads' latents): {shard_full} full, {shard_kept} "
                             "compressed")
        lines += [f"layer {l} left uncompressed: {r}" for l, r in self.unsupported]
        return "\n".join(lines)


def blocks_to_json(blocks: list[AttentionBlock]) -> list[dict]:
    return [b.to_json() for b in blocks]


def _proj(p: Projection | None) -> str:
    if p is None:
        return "-"
    rows = f"[{p.start}:{p.stop}]" if p.rows is None else f"[{p.width} rows in {p.start}:{p.stop}]"
    return f"{p.weight}{'^T' if p.transposed else ''}{rows}"


def _rope(r: RopeLayout) -> str:
    return "-" if r.style == "none" else \
        f"{r.style}{' (turned by -θ)' if r.turn < 0 else ''}/{r.rotary_dim}"


_COLUMNS = ("layer", "ok", "heads/kv/dim", "rope q", "rope k", "scale", "k_path", "op",
            "q", "k", "v", "o", "reason")


def blocks_table(blocks: list[AttentionBlock]) -> str:
    """A fixed-width text table, one row per block."""
    rows = [_COLUMNS]
    for b in blocks:
        rows.append((
            str(b.layer), "yes" if b.supported else "NO",
            f"{b.num_heads}/{b.num_kv_heads}/{b.head_dim}", _rope(b.rope_q), _rope(b.rope_k),
            "-" if b.scale is None else f"{b.scale:.4g}", b.k_path, b.attention_op,
            _proj(b.q), _proj(b.k), _proj(b.v), _proj(b.o), b.reason or b.notes.get("o", ""),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if not blocks:
        lines.append("(no attention found)")
    return "\n".join(lines)
