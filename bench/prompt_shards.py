"""What the per-prompt retrieval diagnoses (``retrieval_layers.py``, ``retrieval_positions.py``)
share: their prompt arguments, the model with the saved plan installed and the prompts, the
prompts a process runs (``--prompts I,J,...``: only those, by index, as ``retrieval.py``'s;
``--shard K/N``: every N-th of them from the K-th, one process a core, each its own
``--out``), and their output: ``OUT.json`` (settings, machine and every prompt's figures, the
other shards' folded in with ``--merge``), then, once every prompt is in, ``OUT.md``."""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch


def add_prompt_args(ap: argparse.ArgumentParser, plan: str, task: str, length: str,
                    trials: int, seed: int, out: str) -> None:
    """``--plan`` (required; ``plan`` its help) and ``--task --length --trials --seed
    --prompts --shard --merge --out``, with these defaults."""
    from lorc_fx.data.retrieval_tasks import TASKS
    ap.add_argument("--plan", required=True, help=plan)
    ap.add_argument("--task", default=task, choices=TASKS)
    ap.add_argument("--length", default=length)
    ap.add_argument("--trials", type=int, default=trials)
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--prompts", default="", help="I,J,...: only these of the --trials "
                    "prompts, by index")
    ap.add_argument("--shard", default="0/1", help="K/N: every N-th of the prompts from the K-th")
    ap.add_argument("--merge", default="", help="other shards' OUT.json, comma-separated")
    ap.add_argument("--out", default=out)


def parse_prompt_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """``ap``'s arguments (``--prompts`` and ``--trials`` among them), ``--prompts I,J,...``
    read into ``args.chosen`` (a list of indices; empty: every prompt) and refused through
    ``ap`` by name unless they are distinct integers below ``--trials``."""
    args = ap.parse_args()
    items = [i.strip() for i in args.prompts.split(",") if i.strip()]
    args.chosen = [int(i) for i in items if i.isdigit()]
    if (len(args.chosen) < len(items) or any(i >= args.trials for i in args.chosen)
            or len(set(args.chosen)) < len(args.chosen)):
        ap.error(f"--prompts: distinct indices of the {args.trials} prompts "
                 f"(0-{args.trials - 1}), not {args.prompts}")
    return args


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


def wanted(args: argparse.Namespace, count: int) -> list[int]:
    """The indices of the prompts the run reads, of ``count``: ``--prompts``'s, or all."""
    return args.chosen or list(range(count))


def mine(args: argparse.Namespace, count: int) -> list[int]:
    """The indices of the prompts, of ``count``, that this process's ``--shard`` runs."""
    k, n = map(int, args.shard.split("/"))
    return wanted(args, count)[k::n]


def described(args: argparse.Namespace) -> str:
    """The prompts read, for a table's title: ``N prompts of seed S``, or the chosen ones."""
    if args.chosen:
        return (f"{len(args.chosen)} chosen prompts (`--prompts`) of {args.trials} of seed "
                f"{args.seed}")
    return f"{args.trials} prompts of seed {args.seed}"


def machine() -> str:
    return f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"


def save(args: argparse.Namespace, length: int, bits_per_value: float | dict[str, float],
         per_prompt: dict[str, dict], count: int) -> dict[str, dict] | None:
    """Write ``OUT.json`` (the settings: the arguments, ``length`` in tokens and the plan's
    bits per value, or each labelled plan's) with the other shards' prompts folded in; every
    read prompt's figures in prompt order where all are in (:func:`wanted` of ``count``),
    else None (and says so)."""
    settings = {"plan": args.plan, "task": args.task, "length": length, "trials": args.trials,
                "seed": args.seed, "bits_per_value": bits_per_value,
                **({"prompts": args.chosen} if args.chosen else {})}
    for other in filter(None, args.merge.split(",")):
        per_prompt.update(json.loads(Path(other).read_text())["prompts"])
    out = Path(f"{args.out}.json")  # not with_suffix: a stem may hold a dot (a plan's bits)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(
        {"settings": settings, "machine": machine(), "prompts": per_prompt}, indent=1))
    read = wanted(args, count)
    if any(str(i) not in per_prompt for i in read):
        print(f"{len(per_prompt)} of {len(read)} prompts: merge the other shards")
        return None
    return {str(i): per_prompt[str(i)] for i in read}


def write_table(args: argparse.Namespace, lines: list[str]) -> None:
    """``OUT.md``, printed too."""
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
