"""How far the default model's keys drift with position, and what that costs a plan's codes.

    python bench/key_drift.py --plans A.safetensors,B.safetensors [--task relay]
        [--length 8k] [--trials 2] [--seed 7] [--texts news,austen,poems]
        [--out bench/results/key_drift-cpu]

Vector codes are fitted on the latents of calibration windows (``search.codebooks``: 256
tokens by default). A long context's later keys need not look like a short window's: this
reads, for retrieval prompts (``--task`` at ``--length``, seed ``--seed``: none of the
evaluation's) and for the evaluation part of natural texts (``--texts``, the first
``--length`` tokens after BOS), every layer's keys before RoPE (its K projection's output) and per
span of positions:

- the drift: how far the span's mean key lies from the mean over positions 1-255, in units
  of each channel's spread there (the norm over channels of the shift over the spread);
- per plan, its keys' coding error there: each coded layer's latents (``basis·k``) coded by
  the plan's books (``codes.vector.reconstruction``, as a cache codes them) against the
  span's own variance about its mean (the sink, position 0, is never coded and left out).

The error is the codes' alone, every layer reading exact keys (no compounding): what a plan
calibrated on short windows cannot code well shows as the error growing with position.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import lorc_fx
from lorc_fx.codes.vector import VectorBook, reconstruction
from lorc_fx.data.models import load_tokenizer
from lorc_fx.data.retrieval_tasks import TASKS, make_samples
from lorc_fx.data.texts import evaluation_part, load_text
from lorc_fx.eval.retrieval import parse_lengths
from lorc_fx.kernels.nearest_codeword import nearest_codeword
from lorc_fx.plan.calibration import owner_module

EDGES = (1, 256, 1024, 4096)  # spans [1, 256), [256, 1024), [1024, 4096), [4096, length)


def spans(length: int) -> list[tuple[int, int]]:
    ends = [e for e in EDGES if e < length] + [length]
    return list(zip(ends, ends[1:]))


@torch.no_grad()
def keys_of(model, blocks, ids: list[int]) -> dict[int, torch.Tensor]:
    """Every supported layer's keys before RoPE on one sequence (its K projection's output,
    found by ``analyze``): ``(tokens, h_kv·d)`` float32."""
    keys: dict[int, torch.Tensor] = {}
    hooks = [model.get_submodule(owner_module(b.k.weight)).register_forward_hook(
        lambda m, a, out, i=b.layer: keys.__setitem__(i, out[0].float()))
        for b in blocks if b.supported]
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return keys


def drift(keys: torch.Tensor, parts: list[tuple[int, int]]) -> list[float]:
    """Each span's mean key's distance from the first span's, in the first span's spreads."""
    first = keys[parts[0][0]:parts[0][1]]
    mean, spread = first.mean(0), first.std(0).clamp_min(1e-6)
    return [float(((keys[a:b].mean(0) - mean) / spread).norm()) for a, b in parts]


def coding_error(keys: torch.Tensor, basis: torch.Tensor, book: VectorBook,
                 parts: list[tuple[int, int]]) -> list[float]:
    """Each span's squared coding error of the latents over their variance about its mean."""
    latents = keys @ basis.float().t()
    error = (reconstruction(latents, book, nearest_codeword) - latents) ** 2
    return [float(error[a:b].sum() / ((latents[a:b] - latents[a:b].mean(0)) ** 2).sum())
            for a, b in parts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", required=True, help="saved plans (report.save), comma-separated")
    ap.add_argument("--task", default="relay", choices=TASKS)
    ap.add_argument("--length", default="8k")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--texts", default="news,austen,poems")
    ap.add_argument("--out", default="bench/results/key_drift-cpu")
    args = ap.parse_args()
    (length,) = parse_lengths(args.length)

    model = lorc_fx.load_model("default")
    tok = load_tokenizer()
    blocks = lorc_fx.analyze(model)
    sources = {f"{args.task} {i}": s.input_ids
               for i, s in enumerate(make_samples(tok, args.task, length, args.trials, args.seed))}
    for name in filter(None, args.texts.split(",")):
        ids = tok(evaluation_part(load_text(name)), add_special_tokens=False).input_ids
        sources[name] = [tok.bos_token_id, *ids[:length - 1]]
    plans = {Path(p).name: lorc_fx.compress(model, plan=p).plan
             for p in filter(None, args.plans.split(","))}

    rows = []
    for source, ids in sources.items():
        keys = keys_of(model, blocks, ids)
        parts = spans(len(ids))
        drifts = [drift(keys[i], parts) for i in sorted(keys)]
        rows.append({"source": source, "what": "drift", "spans": parts,
                     "per_layer": drifts, "mean": torch.tensor(drifts).mean(0).tolist()})
        for name, plan in plans.items():
            errors = {l.layer: coding_error(keys[l.layer], l.k_basis, l.k_code, parts)
                      for l in plan.layers if isinstance(l.k_code, VectorBook)}
            rows.append({"source": source, "what": name, "spans": parts,
                         "per_layer": errors,
                         "mean": torch.tensor(list(errors.values())).mean(0).tolist()})
        print(source, "done", flush=True)

    machine = (f"{platform.machine()}, {torch.get_num_threads()} thread(s), "
               f"torch {torch.__version__}")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "machine": machine, "rows": rows}, indent=1))

    def span_names(parts):
        return " | ".join(f"{a}-{b - 1}" for a, b in parts)

    lines = [f"Keys' drift with position and the codes' error there (`bench/key_drift.py`, "
             f"{args.task} prompts of seed {args.seed} and texts' evaluation parts, "
             f"{length} tokens; {machine}).", "",
             "Drift: the span's mean key from positions 1-255's, in their spreads (mean over "
             "layers). Plans: keys' coding error over the span's variance (mean over coded "
             "layers; in brackets the layer that codes the last span worst).", ""]
    for source in sources:
        mine = [r for r in rows if r["source"] == source]
        lines += [f"**{source}**", "", f"| | {span_names(mine[0]['spans'])} |",
                  "|---" * (len(mine[0]["spans"]) + 1) + "|"]
        for r in mine:
            worst = ""
            if r["what"] != "drift":
                layer, errs = max(r["per_layer"].items(), key=lambda kv: kv[1][-1])
                worst = f" (layer {layer}: {errs[-1]:.3f})"
            lines.append(f"| {r['what']} | " + " | ".join(
                f"{v:.2f}" if r["what"] == "drift" else f"{v:.4f}" for v in r["mean"])
                + f"{worst} |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
