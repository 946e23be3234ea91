"""Find every attention block of a model from its dynamo graphs (no per-family code)."""
from __future__ import annotations

from torch import nn

from passes.attention_match import match_attention
from passes.capture import capture

from .blocks import AttentionBlock, Projection, RopeLayout


def analyze(model: nn.Module, example_inputs=None) -> list[AttentionBlock]:
    """Attention blocks in execution order; ``layer`` counts them from 0.

    ``example_inputs``: as for ``passes.capture.capture`` (default: synthetic token ids).
    """
    captured = capture(model, example_inputs)
    blocks: list[AttentionBlock] = []
    for call in captured.calls:
        for match in match_attention(captured.graphs[call.graph].gm, call.param_names):
            block = match.to_block(len(blocks))
            block.notes["graph"] = call.graph
            blocks.append(block)
    return blocks


def blocks_to_json(blocks: list[AttentionBlock]) -> list[dict]:
    return [b.to_json() for b in blocks]


def _proj(p: Projection | None) -> str:
    if p is None:
        return "-"
    rows = f"[{p.start}:{p.stop}]" if p.rows is None else f"[{p.width} rows in {p.start}:{p.stop}]"
    return f"{p.weight}{'^T' if p.transposed else ''}{rows}"


def _rope(r: RopeLayout) -> str:
    return "-" if r.style == "none" else f"{r.style}/{r.rotary_dim}"


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
