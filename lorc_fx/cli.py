"""The ``lorc`` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from dataclasses import MISSING, fields

from lorc_fx.eval.evaluate import DECODE_AFTER
from lorc_fx.data.retrieval_tasks import HELD_OUT, MIN_LENGTH, NOISE_HAYSTACK, TASKS
from lorc_fx.data.texts import TEXT_NAMES
from lorc_fx.eval.retrieval import RetrievalOptions, parse_lengths
from lorc_fx.plan.options import BUDGET_FIELDS, CalibrationOptions, PlanOptions

_SHOW_DEFAULTS = argparse.ArgumentDefaultsHelpFormatter


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the embedded SmolLM2-135M), a Hugging Face model "
                        "directory, or a .gguf file")


def _add_plan_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """A flag for every field of ``PlanOptions`` (and of its ``CalibrationOptions``, as
    ``--calibration-*``) but ``skip``, from the fields' metadata; the budgets exclusive."""
    budget = (p.add_mutually_exclusive_group() if set(BUDGET_FIELDS) - set(skip) else None)
    for f in fields(PlanOptions):
        if f.name in skip:
            continue
        if f.name == "calibration":
            for inner in fields(CalibrationOptions):
                _add_flag(p, inner, "calibration_")
        else:
            _add_flag(budget if f.name in BUDGET_FIELDS else p, f)


def _add_flag(group, f, prefix: str = "") -> None:
    """The flag of option field ``f`` (none where its help is empty), absent from the parsed
    arguments unless given (``plan_options`` then keeps the field's default)."""
    meta = f.metadata
    if not meta.get("help"):
        return
    default = f.default if f.default is not MISSING else f.default_factory()
    parse = meta["parse"] or type(default)
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    help = meta["help"] + ("" if default is None else f" (default: {shown})")
    flag = "--" + (prefix + (meta["flag"] or f.name)).replace("_", "-")
    if default is False:  # a switch: given, it is on
        group.add_argument(flag, dest=prefix + f.name, action="store_true",
                           default=argparse.SUPPRESS, help=meta["help"].replace("%", "%%"))
        return
    group.add_argument(flag, dest=prefix + f.name, type=_typed(parse), default=argparse.SUPPRESS,
                       metavar=(meta["flag"] or f.name).upper(), help=help.replace("%", "%%"))


def _typed(parse):
    """``parse`` with its ``ValueError`` said by argparse as it is."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _given_options(args: argparse.Namespace) -> dict:
    """The plan option flags given, by field (the calibration's gathered)."""
    given = vars(args)
    options = {f.name: given[f.name] for f in fields(PlanOptions) if f.name in given}
    calibration = {f.name: given["calibration_" + f.name] for f in fields(CalibrationOptions)
                   if "calibration_" + f.name in given}
    if calibration:
        options["calibration"] = CalibrationOptions(**calibration)
    return options


def plan_options(args: argparse.Namespace) -> PlanOptions:
    """The plan options the flags ask for, checked once (``ValueError`` naming the option)."""
    return PlanOptions(**_given_options(args))


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")


def cmd_plan(args: argparse.Namespace) -> None:
    from lorc_fx.api import plan, save_plan
    from lorc_fx.data.models import load_model
    from lorc_fx.report import plan_table, plot_plan

    options = plan_options(args)
    start = time.perf_counter()
    model = load_model(args.model)
    loaded = time.perf_counter()
    result = plan(model, options=options)
    print(plan_table(result))
    print(f"model load {loaded - start:.1f} s, plan {time.perf_counter() - loaded:.1f} s")
    if args.json:
        _write_json(args.json, result.to_json())
    if args.plot:
        plot_plan(result, args.plot)
        print(f"wrote {args.plot}")
    if args.save:
        print(f"wrote {save_plan(result, args.save)}")


def cmd_analyze(args: argparse.Namespace) -> None:
    from lorc_fx.analysis import analyze
    from lorc_fx.report import blocks_table, blocks_to_json
    from lorc_fx.data.models import load_model

    blocks = analyze(load_model(args.model))
    print(blocks_table(blocks))
    if args.json:
        _write_json(args.json, blocks_to_json(blocks))


def _machine() -> dict:
    import os
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _tensor_parallel() -> bool:
    """Join the process group ``torchrun`` set up (gloo on CPU); whether this is rank 0."""
    import os

    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        raise ValueError("--tp runs one process per shard: launch it with torchrun, e.g. "
                         "torchrun --nproc-per-node 2 -m lorc_fx.cli eval --tp ...")
    if not dist.is_initialized():
        dist.init_process_group()  # gloo for CPU tensors, nccl for CUDA ones
    return dist.get_rank() == 0


def _retrieval_options(args: argparse.Namespace) -> RetrievalOptions:
    """``lorc eval --task``'s options, checked before any model loads."""
    if args.compile or args.tp:
        raise ValueError("--task scores greedy generate eagerly on one process; drop "
                         + ("--compile" if args.compile else "--tp"))
    try:
        return RetrievalOptions(task=args.task, lengths=parse_lengths(args.lengths),
                                trials=args.trials, seed=args.seed, haystack=args.haystack)
    except ValueError as err:
        raise ValueError(f"--{err}") from None


def _install(args: argparse.Namespace, model, options: PlanOptions, blocks=None):
    """``compress`` with the saved ``--plan`` or the plan options: the report."""
    from lorc_fx.analysis import analyze
    from lorc_fx.api import compress

    blocks = analyze(model) if blocks is None else blocks
    report = (compress(model, blocks=blocks, plan=args.plan) if args.plan
              else compress(model, blocks=blocks, options=options))
    if report.plan is None:
        raise ValueError(report.left_alone)
    return report


def _eval_task(args: argparse.Namespace, options: PlanOptions) -> None:
    """``lorc eval --task``: retrieval accuracy full vs compressed, per length."""
    from lorc_fx.data.models import load_model, load_tokenizer
    from lorc_fx.data.retrieval_tasks import text_sentences
    from lorc_fx.eval.retrieval import evaluate_retrieval

    task = _retrieval_options(args)
    start = time.perf_counter()
    if task.haystack != NOISE_HAYSTACK:  # a text that cannot be read fails before the model loads
        text_sentences(task.haystack)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    try:  # the context limit is the model's: checked before planning
        task.check_fits(model)
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    report = _install(args, model, options)
    planned = time.perf_counter()
    results = evaluate_retrieval(model, tokenizer, task)
    held = " (the held-out family)" if task.task == HELD_OUT else ""
    print(f"{task.task}{held}, greedy, {task.trials} prompts per length, seed {task.seed}, "
          f"{task.haystack} haystack, "
          f"{report.plan.bits_per_value:.2f} bits per value ({report.plan.scheme.name}); "
          "correct [Wilson 95% interval]:")
    for r in results:
        print(f"  {r.length:>6} tokens: full {r.full}, compressed {r.compressed}; the same "
              f"answer as full on {r.same_answers}/{r.full.trials}")
    if args.json:
        _write_json(args.json, {
            "task": task.task, "held_out": task.task == HELD_OUT, "trials": task.trials,
            "seed": task.seed, "haystack": task.haystack, "lengths": list(task.lengths),
            "scoring": "greedy generate",
            "results": [r.to_json() for r in results],
            "cache_fraction": report.plan.cache_fraction,
            "bits_per_value_plan": report.plan.bits_per_value, "plan": report.to_json(),
            "seconds": {"load_and_plan": planned - start,
                        "generate": time.perf_counter() - planned},
            "machine": _machine()})


def cmd_eval(args: argparse.Namespace) -> None:
    from lorc_fx.analysis import analyze
    from lorc_fx.eval.evaluate import EvalOptions, evaluate, evaluation_inputs
    from lorc_fx.data.models import load_model, load_tokenizer
    from lorc_fx.data.texts import load_text

    if args.plan and _given_options(args):
        raise ValueError("--plan installs a saved plan as it is; drop the plan options ("
                         + ", ".join(f"--{n.replace('_', '-')}" for n in _given_options(args))
                         + ")")
    options = plan_options(args)
    if args.task:
        return _eval_task(args, options)
    scoring = EvalOptions(text=args.text, tokens=args.tokens, window=args.window,
                          decode_after=None if args.one_forward else args.decode_after,
                          prompts=args.prompts, new_tokens=args.new_tokens, compile=args.compile)
    lead = _tensor_parallel() if args.tp else True  # only one process prints and writes
    text = load_text(args.text)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    evaluation_inputs(tokenizer, text, scoring)  # a text too short fails before the model loads
    model = load_model(args.model, tp_plan="auto" if args.tp else None)
    blocks = analyze(model)
    loaded = time.perf_counter()
    report = _install(args, model, options, blocks)
    planned = time.perf_counter()
    result = evaluate(model, tokenizer, text, scoring)
    full_bytes, kept_bytes = report.cache_bytes_per_token()
    out = {
        "ppl_full": result.ppl_full, "ppl_compressed": result.ppl_compressed,
        "ppl_ratio": result.ppl_ratio, "top1_agreement": result.top1_agreement,
        "kl_mean": result.kl_mean, "scoring": result.scoring,
        "generation": result.generation, "text": args.text,
        "tokens": args.tokens, "window": args.window, "cache_fraction": report.plan.cache_fraction,
        "bits_per_value": result.bits_per_value_measured,
        "bits_per_value_plan": report.plan.bits_per_value,
        "cache_bytes_per_token_full": full_bytes,
        "cache_bytes_per_token_compressed": kept_bytes,
        "cache_bytes_per_token_measured": result.cache_bytes_per_token_measured,
        "compiled": args.compile, "plan": report.to_json(),
        "seconds": {"load_and_analyze": loaded - start, "plan": planned - loaded,
                    **result.seconds, "total": time.perf_counter() - start},
        "machine": _machine(),
    }
    if not lead:
        return
    if args.tp:
        shard_full, shard_kept = report.cache_bytes_per_token_per_shard()
        out["cache_bytes_per_token_per_shard_full"] = shard_full
        out["cache_bytes_per_token_per_shard_compressed"] = shard_kept
        print(f"tensor parallel over {report.plan.shards} processes: each caches "
              f"{shard_kept:g}/{shard_full} bytes per token (its own KV heads' share of the "
              "cache)")
    g = result.generation
    print(f"{args.text} ({result.scoring}): perplexity {result.ppl_full:.3f} full, "
          f"{result.ppl_compressed:.3f} "
          f"compressed (x{result.ppl_ratio:.4f}) at cache fraction "
          f"{report.plan.cache_fraction:.3f} ({kept_bytes:g}/{full_bytes} bytes per token; "
          f"{result.bits_per_value_measured:.3f} bits per value measured, floats at 16 bits)")
    generated = ("no greedy generation measured (--prompts 0)" if not result.generation["samples"]
                 else f"greedy generation: {g['token_agreement']:.1%} of tokens agree, "
                      f"{g['exact_match']:.0%} of continuations identical, first difference "
                      f"after {g['mean_common_prefix']:.1f} tokens on average")
    print(f"next-token agreement {result.top1_agreement:.1%}, KL(full ‖ compressed) "
          f"{result.kl_mean:.4f} nats/token; {generated}; "
          f"{out['seconds']['total']:.0f} s")
    if args.json:
        _write_json(args.json, out)


def _fractions(listed: str) -> list[float]:
    try:
        fractions = [float(f) for f in listed.split(",")]
    except ValueError:
        raise ValueError(f"--fractions must be comma-separated numbers in (0, 1], got {listed!r}")
    if not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"--fractions must be numbers in (0, 1], got {listed!r}")
    return fractions


def cmd_sweep(args: argparse.Namespace) -> None:
    from lorc_fx.analysis import analyze
    from lorc_fx.data.models import load_model, load_tokenizer
    from lorc_fx.eval.sweep import parse_configs, plot_sweep, run_sweep
    from lorc_fx.data.texts import load_text

    options = plan_options(args)
    fractions = _fractions(args.fractions)
    configs = parse_configs(args.configs)
    texts = {name: load_text(name) for name in args.texts.split(",")}
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    result = run_sweep(model, tokenizer, analyze(model), texts, fractions, configs,
                       args.tokens, args.window, options, checkpoint=args.json)
    result["machine"] = _machine()
    for row in result["rows"]:
        cells = (" ".join(f"{t} {row['ppl'][t]:8.2f} (x{row['ratio'][t]:.3f}, KL "
                          f"{row['kl'][t]:.4f}, top-1 {row['top1'][t]:.1%})" for t in texts)
                 if "ppl" in row else row["error"].split(":")[0])
        print(f"{row['basis']:>9}/{row['schedule']:<11} {row['requested']:.2f}  {cells}")
    _write_json(args.json, result)
    plot_sweep(result, args.plot)
    print(f"wrote {args.plot}")


def _harness_settings(args: argparse.Namespace) -> None:
    """``lorc lm-eval``'s own options checked, and lm_eval installed, before any model loads."""
    import importlib.util

    for name in ("docs", "doc_words", "max_length", "batch_size"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
    if importlib.util.find_spec("lm_eval") is None:
        raise RuntimeError("lorc lm-eval runs EleutherAI's lm-evaluation-harness, which is not "
                           "installed: pip install 'lorc-fx[harness]' (or pip install lm_eval)")


def cmd_lm_eval(args: argparse.Namespace) -> None:
    from lorc_fx.analysis import analyze
    from lorc_fx.api import compress
    from lorc_fx.data.models import load_model, load_tokenizer, user_cache_dir
    from lorc_fx.data.texts import load_text

    options = plan_options(args)
    _harness_settings(args)
    from lorc_fx.eval.harness import METRICS, documents, harness_scores, write_task

    try:
        docs = documents(load_text(args.text), args.docs, args.doc_words)
    except ValueError as err:
        raise ValueError(f"text {args.text!r}: {err}") from None
    task_dir = args.task_dir or str(user_cache_dir() / "lm-eval")
    task = write_task(args.text, docs, task_dir)
    words = sum(len(d.split()) for d in docs)
    print(f"wrote task {task} ({len(docs)} documents, {words} words) and its data to "
          f"{task_dir}; any model runs it with: lm_eval --model hf --model_args "
          f"pretrained=DIR --include_path {task_dir} --tasks {task}")
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)  # a directory without one fails before the model loads
    model = load_model(args.model)
    harness = dict(max_length=args.max_length, batch_size=args.batch_size)
    full = harness_scores(model, tokenizer, task, task_dir, compressed=False, **harness)
    report = compress(model, blocks=analyze(model), options=options)
    if report.plan is None:
        raise ValueError(report.left_alone)
    compressed = harness_scores(model, tokenizer, task, task_dir, compressed=True, **harness)
    print(f"\n{task} under lm-evaluation-harness (HFLM, windows of {args.max_length} tokens), "
          f"cache fraction {report.plan.cache_fraction:.3f}:")
    for metric in METRICS:
        print(f"  {metric:<16} full {full[metric]:10.4f}  compressed {compressed[metric]:10.4f}"
              f"  (x{compressed[metric] / full[metric]:.4f})")
    if args.json:
        from importlib.metadata import version

        _write_json(args.json, {
            "task": task, "task_dir": task_dir, "text": args.text, "documents": len(docs),
            "words": words, "max_length": args.max_length, "full": full,
            "compressed": compressed, "cache_fraction": report.plan.cache_fraction,
            "plan": report.to_json(), "lm_eval": version("lm_eval"),
            "seconds": time.perf_counter() - start, "machine": _machine()})


def cmd_demo(args: argparse.Namespace) -> None:
    from lorc_fx.eval.demo import run_demo

    run_demo(plan_options(args), args.out, tokens=args.tokens, new_tokens=args.new_tokens,
             compile_speed=not args.no_compile)


def cmd_fetch_austen(args: argparse.Namespace) -> None:
    from lorc_fx.data.texts import fetch_austen

    print(f"Austen novels ready in {fetch_austen()}")


def cmd_fetch_poems(args: argparse.Namespace) -> None:
    from lorc_fx.data.texts import fetch_poems

    print(f"verse (Debian fortunes' songs-poems) ready in {fetch_poems()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorc", description=__doc__,
                                     formatter_class=_SHOW_DEFAULTS)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="how the cache is stored for a budget",
                       formatter_class=_SHOW_DEFAULTS,
                       description="The storage scheme and its layout for a budget (the "
                                   "candidates measured, the per-layer ranks), with the "
                                   "defaults of compress, eval and demo; the paper's plan is "
                                   "--latent-bits 16 --schedule progressive --basis weight.")
    _add_model(p)
    _add_plan_options(p)
    p.add_argument("--json", help="write the plan as JSON")
    p.add_argument("--plot", help="write a PNG of ranks and log κ̃ by layer")
    p.add_argument("--save", help="write the plan (bases, ranks, options, model fingerprint) "
                                  "as a safetensors file, or lorc_plan.safetensors in a "
                                  "directory, for `lorc eval --plan` or compress(model, plan=...)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("analyze", help="attention blocks found in the model's captured graph",
                       formatter_class=_SHOW_DEFAULTS)
    _add_model(p)
    p.add_argument("--json", help="write the records as JSON")
    p.set_defaults(run=cmd_analyze)

    p = sub.add_parser("eval", help="perplexity, next-token agreement and KL, and greedy "
                                    "agreement, full vs compressed cache",
                       formatter_class=_SHOW_DEFAULTS)
    _add_model(p)
    _add_plan_options(p)
    p.add_argument("--text", default="news",
                   help="news | austen | pydoc | code | poems | a UTF-8 text file")
    p.add_argument("--tokens", type=int, default=8192, help="tokens evaluated, in windows")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--decode-after", type=int, default=DECODE_AFTER,
                   help="tokens of each window (at most half of it) the compressed model reads "
                        "in one forward before decoding the rest one token at a time, as "
                        "generate reads the cache")
    p.add_argument("--one-forward", action="store_true",
                   help="read each whole window in one forward instead (labelled so: a cache "
                        "that keeps its newest tokens in full precision reads otherwise than "
                        "decoding does)")
    p.add_argument("--prompts", type=int, default=4,
                   help="greedy-generation prompts (0: no generation measured)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--compile", action="store_true",
                   help="score compiled: the full cache with Inductor, the latent cache "
                        "with lorc_backend")
    p.add_argument("--tp", action="store_true",
                   help="load the model tensor-parallel (transformers' tp_plan='auto') over the "
                        "processes torchrun starts; each caches its own KV heads' latents")
    p.add_argument("--plan", help="install the plan `lorc plan --save` wrote (no calibrating or "
                                  "planning; it must be this model's); plan options are refused")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="score long-context retrieval instead of perplexity: greedy answers "
                        f"of the full and the compressed cache on the same synthetic prompts "
                        f"({HELD_OUT} is the held-out family)")
    p.add_argument("--lengths", default=",".join(map(str, RetrievalOptions.lengths)),
                   help="--task: tokens of prompt and answer, comma-separated (1k = 1024), "
                        f"each in [{MIN_LENGTH}, the model's context limit]")
    p.add_argument("--trials", type=int, default=RetrievalOptions.trials,
                   help="--task: prompts per length (>= 1)")
    p.add_argument("--seed", type=int, default=RetrievalOptions.seed,
                   help="--task: seed of the prompts (>= 0)")
    p.add_argument("--haystack", default=RetrievalOptions.haystack,
                   help=f"--task: the filler around the facts: {NOISE_HAYSTACK} (the passkey "
                        f"test's sentences repeated), or prose, a known text "
                        f"({', '.join(TEXT_NAMES)}) or a text file, from its evaluation part")
    p.add_argument("--json", help="write the results as JSON")
    p.set_defaults(run=cmd_eval)

    p = sub.add_parser("sweep", help="perplexity, next-token KL and agreement over cache "
                                     "fractions and plan options",
                       formatter_class=_SHOW_DEFAULTS)
    _add_model(p)
    _add_plan_options(p, skip=(*BUDGET_FIELDS, "schedule", "basis"))
    p.add_argument("--fractions", default="0.8,0.7,0.6,0.5",
                   help="comma-separated cache fractions in (0, 1]")
    p.add_argument("--configs", default="weight:progressive,weight:uniform,whitened:uniform,"
                                        "whitened:calibrated,attention:greedy,attention:calibrated",
                   help="comma-separated basis:schedule[:rope] configs (rope: else --rope)")
    p.add_argument("--texts", default="news,austen", help="comma-separated evaluation texts")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per text, in windows")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--json", default="sweep.json",
                   help="results, written after every row; a rerun resumes from it")
    p.add_argument("--plot", default="sweep.png", help="PNG of perplexity ratio by fraction")
    p.set_defaults(run=cmd_sweep)

    p = sub.add_parser("lm-eval", help="word perplexity under EleutherAI's lm-evaluation-"
                                       "harness, uncompressed vs compressed (needs lm_eval)",
                       formatter_class=_SHOW_DEFAULTS,
                       description="Rolling log-likelihood (word and byte perplexity, bits "
                                   "per byte) of the model through lm_eval's HFLM, first "
                                   "uncompressed, then compressed (its forward through the "
                                   "latent cache), on a local task written from a text's "
                                   "evaluation part. Nothing is downloaded.")
    _add_model(p)
    _add_plan_options(p)
    p.add_argument("--text", default="news",
                   help="news | austen | pydoc | code | poems | a UTF-8 text file")
    p.add_argument("--docs", type=int, default=8, help="documents scored")
    p.add_argument("--doc-words", type=int, default=300,
                   help="least words per document (consecutive evaluation paragraphs)")
    p.add_argument("--max-length", type=int, default=512,
                   help="tokens per rolling window the harness scores")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    p.add_argument("--task-dir", default=None,
                   help="where the task YAML and its JSON lines are written (None: "
                        "lm-eval/ in lorc_fx's cache)")
    p.add_argument("--json", help="write the results as JSON")
    p.set_defaults(run=cmd_lm_eval)

    p = sub.add_parser("demo", help="plan, quality and compiled speed on the default model",
                       formatter_class=_SHOW_DEFAULTS)
    _add_plan_options(p)
    p.add_argument("--out", default="lorc-report", help="directory for the report's files")
    p.add_argument("--tokens", type=int, default=2048, help="news tokens for perplexity")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled speed test")
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("fetch-austen", help="download Debian's r-cran-janeaustenr into the cache",
                       formatter_class=_SHOW_DEFAULTS)
    p.set_defaults(run=cmd_fetch_austen)
    p = sub.add_parser("fetch-poems", help="download Debian's fortunes (verse) into the cache",
                       formatter_class=_SHOW_DEFAULTS)
    p.set_defaults(run=cmd_fetch_poems)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, LookupError, RuntimeError) as err:
        print(f"lorc: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
