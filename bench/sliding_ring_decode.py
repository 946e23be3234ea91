"""Compiled decode past a sliding window over a static cache: a Gemma-3-270M-shaped model
(random weights, float32; 18 layers, five of every six sliding over a window of 512 tokens)
with plain int8 KV quantization, its decode steps compiled with ``lorc_backend``, against the
same model uncompressed, its decode steps compiled by Inductor (``compile_decode``), both
``generate`` with ``cache_implementation="static"``, in ONE
process, alternated round by round (bench/decode_ab.py's timing: the median step after
``--warmup-steps``, a ``LogitsProcessor`` stamping each step).

    OMP_NUM_THREADS=1 python bench/sliding_ring_decode.py --context 2048 --rounds 4

Past the window a sliding layer's static ring returns its last ``W`` tokens gathered in order
(``LatentStaticSlidingLayer``); the compiled decode step reads them from the ring's codes
(``compile.quantized_attention``: each token's slot, ``order``) rather than dequantizing the
ring and gathering it. The uncompressed model runs ``TRANSFORMERS_SDPA_FORCE_GQA=1`` (its
SDPA reads the cache in place: bench/long_context.py's faster ``full-gqa``). Appends a record
to bench/results/sliding_ring_decode-cpu.jsonl.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.analysis import analyze  # noqa: E402
from lorc_fx.analysis.records import named_params  # noqa: E402
from lorc_fx.plan.options import PlanOptions  # noqa: E402
from lorc_fx.plan.planner import layer_inputs, plain_quantized_plan  # noqa: E402
from decode_ab import alternated, decode_steps  # noqa: E402

OUT = Path(__file__).parent / "results" / "sliding_ring_decode-cpu.jsonl"
VOCAB = 32000  # Gemma 3's 262k-token embedding would be most of the step: not the cache's


def gemma3_270m_shaped(window: int) -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=640, intermediate_size=2048,
                              num_hidden_layers=18, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=256, sliding_window=window,
                              max_position_embeddings=32768)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def compile_decode(model, backend) -> None:
    """``model``'s one-token forward calls (the decode steps, what this bench times)
    compiled with ``backend``, the prefill eager: it would only add its compile time (a few
    minutes for either model). Not ``CompileConfig(backend=...)``: ``generate`` deep-copies
    it, and with it the backend, so each timed call compiled afresh."""
    eager, compiled = model.forward, torch.compile(model.forward, backend=backend)

    @functools.wraps(eager)  # generate checks its arguments against forward's signature
    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        return (compiled if ids is not None and ids.shape[1] == 1 else eager)(*args, **kwargs)

    model.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup-steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.context <= args.window:
        ap.error(f"--context {args.context} must pass --window {args.window}")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ids = torch.randint(3, VOCAB, (1, args.context), generator=torch.Generator().manual_seed(0))

    model = gemma3_270m_shaped(args.window)
    blocks = analyze(model)
    plan = plain_quantized_plan(layer_inputs(named_params(model), blocks),
                                PlanOptions(latent_bits=8))
    lorc_fx.compress(model, plan=plan, blocks=blocks, progress=False)
    compile_decode(model, lorc_fx.lorc_backend)
    compressed = decode_steps(model, ids, args.new_tokens, "static", args.warmup_steps)[1]
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"  # read when the full model's SDPA traces
    full = gemma3_270m_shaped(args.window)
    compile_decode(full, "inductor")
    uncompressed = decode_steps(full, ids, args.new_tokens, "static", args.warmup_steps)[1]
    ms = alternated({"int8": lambda: decode_steps(model, ids, args.new_tokens, "static",
                                                  args.warmup_steps)[0],
                     "full": lambda: decode_steps(full, ids, args.new_tokens, "static",
                                                  args.warmup_steps)[0]}, args.rounds)
    ratios = [f / c for f, c in zip(ms["full"], ms["int8"])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    record = {"context": args.context, "window": args.window, "new_tokens": args.new_tokens,
              "warmup_steps": args.warmup_steps, "commit": commit,
              "bits_per_value": plan.bits_per_value,
              "same_tokens": bool(torch.equal(compressed, uncompressed)),
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "loadavg_end": os.getloadavg(), "step_ms": ms, "round_ratios": ratios,
              "median_ratio": statistics.median(ratios)}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print("full ÷ int8 step, per round: " + ", ".join(f"x{x:.2f}" for x in ratios)
          + f"; median x{record['median_ratio']:.2f} (above 1: the compressed model faster); "
          f"same greedy tokens as the full model: {record['same_tokens']}")


if __name__ == "__main__":
    main()
