"""Long-context retrieval against context length and bits per value (issue #38): the
project's plans (``compress(model, bits_per_value=B)``) beside transformers' ``QuantizedCache``
(optimum-quanto int4 / int2) and the full cache, greedy, on the same prompts.

    OMP_NUM_THREADS=1 python bench/retrieval.py [--task passkey] [--lengths 1k,2k,4k,8k]
        [--trials 10] [--seed 0] [--haystack noise] [--budgets 8.5,4.5,3,2.56,1.92]
        [--plans 2.56=PLAN.safetensors,LABEL=PLAN.safetensors]
        [--quanto 4,2] [--one-prefill [--shard K/N] [--merge A.json,...]] [--prompts I,J,...]
        [--out bench/results/retrieval-cpu]

The prompts are ``lorc_fx.eval.retrieval.make_samples`` (the tasks of ``lorc eval --task``);
each method answers every prompt with greedy ``generate`` (``NEW_TOKENS`` tokens, a fresh cache
per prompt; the answer is right when the first number written is the key). Accuracy comes with
its Wilson 95% interval.

``--plans B=PATH`` installs a saved plan for budget ``B`` instead of planning it (vector plans
take tens of minutes to plan on 2 cores); a label that is not one of ``--budgets`` adds the
plan as a method of its own, ``lorc LABEL`` (e.g. the same plan with an option changed).

``--one-prefill``: the full cache and every plan answer each prompt from one forward of it
(``retrieval.answers_sharing_prefill``: a compressed cache's prefill computes what the full
model's does, so one forward writes every cache; each then decodes on its own, as ``generate``
would, tested token for token against it). Quanto's caches are written by that forward too
(its prefill hands back the keys and values it was given, so the forward is the full model's;
its answers matched ``generate``'s token for token on 6 multikey prompts of 1k tokens, int4 and
int2, 2026-12-03). At 8k tokens the prompt's forward is ~1.5 min of one thread and each cache's
eight steps seconds, so this is what makes 8k affordable. Progress is kept after every prompt
(``OUT.json``'s ``partial``).
``--shard K/N`` runs every N-th prompt from the K-th (one process a core, each its own
``--out``); a last run with ``--merge`` of the shards' files writes the rows.

``--prompts I,J,...`` reads only those of the ``--trials`` prompts (their indices), e.g. the
ones any cache answered in an earlier run of all of them, to read more plans at 8k: a row then
counts the chosen prompts' answers, a lower bound of what every prompt would give, and no
plot is drawn (its accuracies would not be the task's).

Quanto's cache (``QuantizedCache(backend="quanto")``, its defaults: groups of 64, the newest
up to 128 tokens unquantized, which after a prompt holds only the generated tokens) is
reported at its nominal bits per value, floats at 16 bits as for the project's plans:
``b + 2 * 16 / 64``. optimum-quanto (``pip install -e ".[peers]"``)
builds its C++ extension on first use (2.5 min on the 2-core machine).

Writes ``OUT.json`` after every row (rows already there are kept, so a rerun resumes; a row is
a method at a length), ``OUT.md`` and ``OUT.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.data.retrieval_tasks import (HELD_OUT, NEW_TOKENS, NOISE_HAYSTACK, TASKS,  # noqa: E402
                                          make_samples)
from lorc_fx.eval.retrieval import (Accuracy, accuracy, answers,  # noqa: E402
                                    answers_sharing_prefill, parse_lengths, same_answer)
from prompt_shards import parse_prompt_args, wanted  # noqa: E402  (bench/'s own)

QUANTO_GROUP = 64  # QuantizedCache's default q_group_size


def quanto_bits(bits: int) -> float:
    """Quanto's nominal bits per value at ``bits``: the codes, and a scale and a zero point
    a group counted at 16 bits, as the plans count floats."""
    return bits + 2 * 16 / QUANTO_GROUP


def quanto_cache(model, bits: int):
    """A fresh ``QuantizedCache`` (quanto, ``bits``, its other options the defaults)."""
    from transformers.cache_utils import QuantizedCache

    return QuantizedCache(backend="quanto", config=model.config.get_text_config(decoder=True),
                          nbits=bits)


def quanto_answers(model, tokenizer, samples, bits: int) -> list[str]:
    """Greedy answers through a fresh ``QuantizedCache`` (quanto, ``bits``) per prompt."""
    out = []
    for s in tqdm(samples, desc=f"quanto int{bits}", leave=False):
        ids = torch.tensor([s.input_ids])
        cache = quanto_cache(model, bits)
        seq = model.generate(ids, past_key_values=cache, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(tokenizer.decode(seq[0, ids.shape[1]:]))
    return out


def _row(method: str, bits: float, length: int, samples, outputs, seconds: float,
         indices: list[int]) -> dict:
    return {"method": method, "bits_per_value": bits, "length": length,
            **accuracy(samples, outputs).to_json(), "seconds": seconds,
            "outputs": [{"prompt": i, "depth": s.depth, "answer": s.answer, "output": o}
                        for i, s, o in zip(indices, samples, outputs)]}


def _cell(row: dict, full: dict | None) -> str:
    cell = str(Accuracy(row["correct"], row["trials"]))
    if full is None:
        return cell
    same = sum(same_answer(a["output"], b["output"])
               for a, b in zip(full["outputs"], row["outputs"]))
    return f"{cell}, same as full {same}/{row['trials']}"


def write_table(result: dict, path: Path) -> None:
    rows = result["rows"]
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    s = result["settings"]
    of = (f"{len(s['prompts'])} chosen prompts (`--prompts`) of {s['trials']}"
          if "prompts" in s else str(s["trials"]))
    lines = [f"# Retrieval: {s['task']}{' (held out)' if s['task'] == HELD_OUT else ''}, "
             f"correct of {of} [Wilson 95% interval]", "",
             f"Default model, greedy, {NEW_TOKENS} new tokens, seed {s['seed']}, "
             f"haystack {s.get('haystack', NOISE_HAYSTACK)}; "
             f"{result['machine']['cpu']}, {result['machine']['cores']} cores (shared), "
             f"{result['machine']['threads']} thread(s), torch {result['machine']['torch']}. "
             "Produced by `bench/retrieval.py`"
             + (" `--one-prefill`: one forward of each prompt wrote every cache (the full "
                "cache, each plan's, quanto's), each then decoding on its own as `generate` "
                "would."
                if s.get("one_prefill") else "."), "",
             "| method | bits per value | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    full = {r["length"]: r for r in rows if r["method"] == "full cache"}
    for m in methods:
        cells = {r["length"]: r for r in rows if r["method"] == m}
        bits = next(iter(cells.values()))["bits_per_value"]
        lines.append(f"| {m} | {bits:.3g} | " + " | ".join(
            _cell(cells[n], full.get(n) if m != "full cache" else None) if n in cells else "–"
            for n in lengths) + " |")
    lines += ["", "Each cell: correct of the prompts [Wilson 95% interval]; beside the full cache, "
              "on how many prompts the method gave the full cache's answer, right or wrong. "
              "Bits per value: the plan's, floats at 16 bits; quanto's nominal (b + 2·16/64)."]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    for i, m in enumerate(methods):
        rows = sorted((r for r in result["rows"] if r["method"] == m), key=lambda r: r["length"])
        x = [r["length"] * (1 + 0.02 * (i - len(methods) / 2)) for r in rows]  # apart
        y = [r["accuracy"] for r in rows]
        err = [[a - r["interval95"][0] for a, r in zip(y, rows)],
               [r["interval95"][1] - a for a, r in zip(y, rows)]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy (Wilson 95%)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{result['settings']['task']}, {result['settings']['trials']} prompts per length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def install(model, b: float, plans: dict):
    """Budget ``b``'s plan on ``model``: its saved plan (``--plans``), else planned."""
    return (lorc_fx.compress(model, plan=plans[f"{b:g}"]) if f"{b:g}" in plans
            else lorc_fx.compress(model, bits_per_value=b))


def lorc_methods(budgets: list[float], plans: dict) -> dict:
    """The project's methods by name, each with how it is installed on a model: every
    budget (its saved plan or planned here), then every other saved plan by its label."""
    methods = {f"lorc {b:g}": lambda model, b=b: install(model, b, plans) for b in budgets}
    for label, path in plans.items():
        methods.setdefault(f"lorc {label}", lambda model, path=path:
                           lorc_fx.compress(model, plan=path))
    return methods


def one_prefill(model, tok, samples: dict, methods: dict, quanto: list[int],
                result: dict, saved: Path, shard: tuple[int, int], indices: list[int]) -> None:
    """Rows of the full cache, of every one of ``methods``' plans and of quanto at each of
    ``quanto``'s widths, from one prefill a prompt. The outputs so far are kept in
    ``result["partial"][length][method][prompt index]`` after every prompt; ``shard``
    ``(k, n)``: only every ``n``-th of ``samples``' prompts from the ``k``-th (another
    process's shard merged in with ``--merge``); ``indices``: each prompt's index among the
    task's. A length's rows are written once every prompt has its outputs."""
    installed = {name: installs(model).plan for name, installs in methods.items()}
    peers = {f"quanto int{b}": lambda b=b: quanto_cache(model, b) for b in quanto}
    bits = {"full cache": 16.0, **{n: p.bits_per_value for n, p in installed.items()},
            **{f"quanto int{b}": quanto_bits(b) for b in quanto}}
    blocks = lorc_fx.analyze(model)
    done = {(r["method"], r["length"]) for r in result["rows"]}
    for n, prompts in samples.items():
        if all((m, n) in done for m in bits):
            continue
        partial = result.setdefault("partial", {}).setdefault(str(n), {})
        partial.setdefault("seconds", 0.0)
        for m in bits:
            partial.setdefault(m, {})
        todo = [i for i in range(len(prompts))
                if i % shard[1] == shard[0] and str(indices[i]) not in partial["full cache"]]
        for i in tqdm(todo, desc=f"{n} tokens"):
            start = time.perf_counter()
            outputs = answers_sharing_prefill(model, tok, prompts[i:i + 1], installed, blocks,
                                              peers)
            for m in bits:
                partial[m][str(indices[i])] = outputs[m][0]
            partial["seconds"] += time.perf_counter() - start
            saved.write_text(json.dumps(result, indent=1))
        if len(partial["full cache"]) < len(prompts):
            continue  # other shards' prompts to come
        for m, b in bits.items():
            if (m, n) not in done:
                outputs = [partial[m][str(i)] for i in indices]
                result["rows"].append(
                    _row(m, b, n, prompts, outputs, partial["seconds"], indices))
                row = result["rows"][-1]
                print(f"{m:>16} {n:>6} tokens: {Accuracy(row['correct'], row['trials'])}",
                      flush=True)
        del result["partial"][str(n)]
        saved.write_text(json.dumps(result, indent=1))


def merge_partial(result: dict, others: list[Path], lengths: list[int]) -> None:
    """Fold other shards' partial outputs (their ``OUT.json``) at ``lengths`` into
    ``result``'s (another length's are left out: no row of this run would take them)."""
    for other in others:
        for n, methods in json.loads(other.read_text()).get("partial", {}).items():
            if int(n) not in lengths:
                continue
            mine = result.setdefault("partial", {}).setdefault(n, {"seconds": 0.0})
            mine["seconds"] = mine.get("seconds", 0.0) + methods["seconds"]
            for m, outputs in methods.items():
                if m != "seconds":
                    mine.setdefault(m, {}).update(outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="passkey", choices=TASKS)
    ap.add_argument("--lengths", default="1k,2k,4k,8k")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haystack", default=NOISE_HAYSTACK,
                    help="the filler: noise (sentences repeated) or a text's name or file")
    ap.add_argument("--budgets", default="8.5,4.5,3,2.56,1.92", help="bits per value ('' none)")
    ap.add_argument("--plans", default="", help="B=PATH,...: saved plans for budgets B "
                    "(or, for a label B not in --budgets, methods of their own)")
    ap.add_argument("--quanto", default="4,2", help="quanto bit widths ('' none)")
    ap.add_argument("--one-prefill", action="store_true",
                    help="one forward of each prompt writes every method's cache (see above)")
    ap.add_argument("--shard", default="0/1", help="K/N: with --one-prefill, the prompts whose "
                    "index is K modulo N (N processes, one each; then --merge)")
    ap.add_argument("--merge", default="", help="with --one-prefill: other shards' OUT.json "
                    "files, comma-separated, whose outputs count as this run's")
    ap.add_argument("--prompts", default="", help="I,J,...: only these of the --trials "
                    "prompts, by index (their counts: lower bounds of all prompts'; no plot)")
    ap.add_argument("--out", default="bench/results/retrieval-cpu")
    args = parse_prompt_args(ap)
    chosen, indices = args.chosen, wanted(args, args.trials)
    lengths = parse_lengths(args.lengths)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    quanto = [int(b) for b in args.quanto.split(",") if b]
    plans = dict(item.split("=", 1) for item in args.plans.split(",") if item)
    methods = lorc_methods(budgets, plans)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"task": args.task, "trials": args.trials, "seed": args.seed,
                **({"haystack": args.haystack} if args.haystack != NOISE_HAYSTACK else {}),
                **({"one_prefill": True} if args.one_prefill else {}),
                **({"prompts": chosen} if chosen else {})}
    saved = Path(f"{out}.json")
    result = json.loads(saved.read_text()) if saved.exists() else {}
    if result.get("settings") != settings:
        result = {"settings": settings, "rows": []}
    result["machine"] = {"cpu": platform.processor() or platform.machine(),
                         "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                         "torch": torch.__version__}
    done = {(r["method"], r["length"]) for r in result["rows"]}

    model, tok = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    samples = {}
    for n in lengths:
        every = make_samples(tok, args.task, n, args.trials, args.seed, haystack=args.haystack)
        samples[n] = [every[i] for i in indices]

    def run(method: str, bits: float, answer) -> None:
        for n in lengths:
            if (method, n) in done:
                continue
            start = time.perf_counter()
            outputs = answer(samples[n])
            row = _row(method, bits, n, samples[n], outputs, time.perf_counter() - start,
                       indices)
            result["rows"].append(row)
            saved.write_text(json.dumps(result, indent=1))
            print(f"{method:>16} {n:>6} tokens: {Accuracy(row['correct'], row['trials'])}",
                  flush=True)

    if args.one_prefill:
        merge_partial(result, [Path(f) for f in args.merge.split(",") if f], lengths)
        shard = tuple(int(k) for k in args.shard.split("/"))
        one_prefill(model, tok, samples, methods, quanto, result, saved, shard, indices)
    else:
        run("full cache", 16.0, lambda s: answers(model, tok, s, compressed=False))
    for name, installs in methods.items():
        if args.one_prefill or all((name, n) in done for n in lengths):
            continue
        bits = installs(model).plan.bits_per_value
        run(name, bits, lambda s: answers(model, tok, s, compressed=True))
    for bits in [] if args.one_prefill else quanto:
        run(f"quanto int{bits}", quanto_bits(bits),
            lambda s, bits=bits: quanto_answers(model, tok, s, bits))
    write_table(result, Path(f"{out}.md"))
    drawn = not chosen and plot(result, Path(f"{out}.png"))
    why = "--prompts chose the prompts" if chosen else "matplotlib is not installed"
    print(f"wrote {out}.json, {out}.md" + (f", {out}.png" if drawn else f" (no plot: {why})"))


if __name__ == "__main__":
    main()
