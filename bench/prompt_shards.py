"""What the per-prompt retrieval diagnoses (``retrieval_layers.py``, ``retrieval_positions.py``)
share: their prompt arguments, the model with the saved plan installed and the prompts, the shard of prompts a process runs (``--shard K/N``: one
process a core, each its own ``--out``), and their output: ``OUT.json`` (settings, machine
and every prompt's figures, the other shards' folded in with ``--merge``), then, once every
prompt is in, ``OUT.md``."""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch


def add_prompt_args(ap: argparse.ArgumentParser, plan: str, task: str, length: str,
                    trials: int, seed: int, out: str) -> None:
    """``--plan`` (required; ``plan`` its help) and ``--task --length --trials --seed
    --shard --merge --out``, with these defaults."""
    from lorc_fx.data.retrieval_tasks import TASKS
    ap.add_argument("--plan", required=True, help=plan)
    ap.add_argument("--task", default=task, choices=TASKS)
    ap.add_argument("--length", default=length)
    ap.add_argument("--trials", type=int, default=trials)
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--shard", default="0/1", help="K/N: the prompts whose index is K modulo N")
    ap.add_argument("--merge", default="", help="other shards' OUT.json, comma-separated")
    ap.add_argument("--out", default=out)


def prompts_for(args: argparse.Namespace):
    """``(length, model, tokenizer, samples)``: ``--length`` in tokens, the default model as
    it came, its tokenizer and the prompts of ``--task --trials --seed`` at that length."""
    import lorc_fx
    from lorc_fx.data.models import load_tokenizer
    from lorc_fx.data.retrieval_tasks import make_samples
    from lorc_fx.eval.retrieval import parse_lengths

    (length,) = parse_lengths(args.length)
    model, tok = lorc_fx.load_model("default"), load_tokenizer()
    return length, model, tok, make_samples(tok, args.task, length, args.trials, args.seed)


def planned_prompts(args: argparse.Namespace):
    """``(length, model, tokenizer, plan, samples)``: :func:`prompts_for`'s, the model with
    ``--plan`` installed and the plan."""
    import lorc_fx

    length, model, tok, samples = prompts_for(args)
    plan = lorc_fx.compress(model, plan=args.plan).plan
    return length, model, tok, plan, samples


def mine(args: argparse.Namespace, count: int) -> list[int]:
    """The indices of the ``count`` prompts this process's ``--shard`` runs."""
    k, n = map(int, args.shard.split("/"))
    return list(range(k, count, n))


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"


def save(args: argparse.Namespace, length: int, bits_per_value: float | dict[str, float],
         per_prompt: dict[str, dict], count: int) -> dict[str, dict] | None:
    """Write ``OUT.json`` (the settings: the arguments, ``length`` in tokens and the plan's
    bits per value, or each labelled plan's) with the other shards' prompts folded in; every
    prompt's figures in prompt order where all ``count`` are in, else None (and says so)."""
    settings = {"plan": args.plan, "task": args.task, "length": length, "trials": args.trials,
                "seed": args.seed, "bits_per_value": bits_per_value}
    for other in filter(None, args.merge.split(",")):
        per_prompt.update(json.loads(Path(other).read_text())["prompts"])
    out = Path(f"{args.out}.json")  # not with_suffix: a stem may hold a dot (a plan's bits)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(
        {"settings": settings, "machine": machine(), "prompts": per_prompt}, indent=1))
    if len(per_prompt) < count:
        print(f"{len(per_prompt)} of {count} prompts: merge the other shards")
        return None
    return {str(i): per_prompt[str(i)] for i in range(count)}


def write_table(args: argparse.Namespace, lines: list[str]) -> None:
    """``OUT.md``, printed too."""
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
