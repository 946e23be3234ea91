"""Human-readable views of a plan: a per-layer table and a PNG."""
from __future__ import annotations

from .plan import Plan


def plan_table(plan: Plan) -> str:
    header = f"{'layer':>5} {'K rank':>9} {'V rank':>9} {'κ(W_k)':>10} {'κ(W_v)':>10} {'log κ̃':>8}  skipped"
    lines = [header, "-" * len(header)]
    for l in plan.layers:
        lines.append(
            f"{l.layer:>5} {l.k_rank:>4}/{l.k_full:<4} {l.v_rank:>4}/{l.v_full:<4} "
            f"{l.kappa_k:>10.3g} {l.kappa_v:>10.3g} {l.log_kappa_cum:>8.2f}  "
            f"{'yes' if l.skipped else 'no'}{'  ' + l.note if l.note else ''}")
    o = plan.options
    lo, hi = plan.reachable
    lines.append(
        f"cache fraction: {plan.cache_fraction:.4f} (requested {o.cache_fraction:.4f}; "
        f"{o.schedule} schedule reaches [{lo:.3f}, {hi:.3f}]; basis={o.basis}, rope={o.rope})")
    return "\n".join(lines)


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
