"""The ``lorc`` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M), a Hugging Face model directory, or a .gguf file")


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-fraction", type=float, default=0.6,
                   help="kept K+V cache bytes / full K+V cache bytes, in (0, 1]")
    p.add_argument("--schedule", default="progressive")
    p.add_argument("--rope", default="commute", help="commute | reconstruct")
    p.add_argument("--basis", default="weight")
    p.add_argument("--skip-threshold", type=float, default=None,
                   help="layers whose cumulative condition number exceeds this stay full")
    p.add_argument("--keep-first", type=int, default=0, help="the first N layers stay full")
    p.add_argument("--rank-multiple", type=int, default=8)


def _plan_kwargs(args: argparse.Namespace) -> dict:
    return dict(cache_fraction=args.cache_fraction, schedule=args.schedule, rope=args.rope,
                basis=args.basis, skip_threshold=args.skip_threshold,
                keep_first=args.keep_first, rank_multiple=args.rank_multiple)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")


def cmd_plan(args: argparse.Namespace) -> None:
    from .api import plan
    from .models import load_model
    from .report import plan_table, plot_plan

    start = time.perf_counter()
    model = load_model(args.model)
    loaded = time.perf_counter()
    result = plan(model, **_plan_kwargs(args))
    print(plan_table(result))
    print(f"model load {loaded - start:.1f} s, plan {time.perf_counter() - loaded:.1f} s")
    if args.json:
        _write_json(args.json, result.to_json())
    if args.plot:
        plot_plan(result, args.plot)
        print(f"wrote {args.plot}")


def cmd_analyze(args: argparse.Namespace) -> None:
    from .analysis import analyze, blocks_table, blocks_to_json
    from .models import load_model

    blocks = analyze(load_model(args.model))
    print(blocks_table(blocks))
    if args.json:
        _write_json(args.json, blocks_to_json(blocks))


def cmd_fetch_austen(args: argparse.Namespace) -> None:
    from .texts import fetch_austen

    print(f"Austen novels ready in {fetch_austen()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="per-layer LoRC ranks for a cache fraction")
    _add_model(p)
    _add_plan_options(p)
    p.add_argument("--json", help="write the plan as JSON")
    p.add_argument("--plot", help="write a PNG of ranks and log κ̃ by layer")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("analyze", help="attention blocks found in the model's captured graph")
    _add_model(p)
    p.add_argument("--json", help="write the records as JSON")
    p.set_defaults(run=cmd_analyze)

    p = sub.add_parser("fetch-austen", help="download Debian's r-cran-janeaustenr into the cache")
    p.set_defaults(run=cmd_fetch_austen)
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
