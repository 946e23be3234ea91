"""Every decoder-only causal-LM family of the installed transformers, compressed by
``lorc_fx.compress`` as a new user would: does it run, how much does the cache shrink, and is
full rank exact?

    OMP_NUM_THREADS=1 python bench/families.py [--families llama gemma2 ...] [--timeout 120]
        [--out bench/results/families-cpu] [--update]

For each family of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (encoder-decoder configs and
composite multimodal ones, which hold a ``text_config``, are skipped with the reason), in a
fresh process (``--family NAME``) under a timeout:

1. A tiny random model from the config class's defaults, shrunk (``tiny_config``): hidden 64,
   4 heads, 2 KV heads, head dim 16, intermediate 128 (MoE: 4 experts, 2 per token), vocab 128,
   positions >= 512, float32, eval; as few layers as keep every per-layer pattern of the
   config (sliding/full, conv/attention, dense/MoE: ``layer_types`` and the like); ``FAMILY``
   sets what a family's defaults leave broken at these sizes (or in transformers 5.23 itself:
   DBRX, MusicGen), ``UNRUNNABLE`` says why a family cannot generate alone. If it cannot be
   built or cannot ``generate`` uncompressed, it is "could not build/run".
2. Transformers' own cache after greedy ``generate`` (``disable_compile=True``,
   ``use_cache=True``: MPT's config turns the cache off) of a random
   16-token prompt, batch 1, 8 new tokens: its class, its layers' classes and the bytes of
   the keys and values it holds (float32). None held: lorc_fx should leave it alone.
   A family whose ``generate`` caches less than the 249-token prompt (MusicGen's caches only
   its last token) decodes as many more tokens as reach 256 cached; one that caches tokens
   besides the prompt's (CPM-Ant's 32 prompt embeddings) gets a prompt as much shorter.
3. ``lorc_fx.compress(model, progress=False)`` (the package's defaults), the same
   ``generate``: the bytes the compressed cache holds (``LatentCache.cache_bytes``: codes,
   scales, full-precision windows, uncompressed layers' keys and values) over the float32
   cache's of the same tokens; also after a 249-token prompt (256 cached tokens: whole
   groups of 64), and the fraction the report plans per token. The report's per-layer lines
   (stored, kept full, left uncompressed, left alone) are recorded.
4. A copy of the model taken before step 3, ``compress(cache_fraction=1.0, latent_bits=16)``:
   greedy ``generate`` of 12 tokens (eager) for two 16-token prompts, the second left-padded by
   3 tokens, token for token against the uncompressed model; then the same model compiled
   with ``lorc_backend`` (rewritten graphs run as they are, no Inductor), the same
   ``generate``, and the most attention calls a graph read absorbed (an SDPA call, or either
   of manual attention's two products).
5. Where the report says MLA (its cache already the latent), a copy of the uncompressed model
   compiled with ``lorc_backend`` (rewritten graphs run as they are): step 4's generate,
   token for token, and how many blocks each graph read absorbed (``absorb_mla``).

A failing step records the exception's type, the first line of its message and the innermost
lorc_fx frame of its traceback; later steps still run. lorc_fx's on-disk caches
(``LORC_CACHE_DIR``, and Inductor's, which holds its C++ kernel) go to a temporary directory.
Writes ``OUT.json`` (one record per family) and ``OUT.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

OUT = Path(__file__).parent / "results" / "families-cpu"
GOAL = 0.30
SHORT, LONG, NEW, EXACT_NEW, PAD = 16, 249, 8, 12, 3
SIZES = {  # config field -> tiny value, set where the config class has the field
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embedding_size": 64,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_attention_heads_per_layer": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "kv_n_heads": 2, "swa_num_key_value_heads": 2,
    "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16, "swa_head_dim": 16,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "ffn_hidden_size": 128,
    "dim_ff": 128, "decoder_ffn_dim": 128, "prefix_dense_intermediate_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_top_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_num_shared_experts": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_num_heads": 2, "linear_head_dim": 16,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16,
    "mamba_expand": 2, "state_size": 16, "expand": 2, "n_groups": 1,
    "attn_layer_period": 2, "attn_layer_offset": 1, "rotary_dim": 8, "moe_k": 2,
    "mamba_d_ssm": 128, "emb_dim": 64, "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16, "is_decoder": True,
    "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
FAMILY = {  # where the defaults break a constraint of the tiny sizes or drop the attention
    "mamba2": {"num_heads": 8},  # SSM heads × head dim = 2 × hidden
    "zaya": {"num_experts_per_tok": 1},
    "dots3_note": {"num_key_value_heads": 4}, "dots3_note_text": {"num_key_value_heads": 4},
    "reformer": {"axial_pos_embds_dim": [32, 32]},  # must sum to hidden
    "gemma3n_text": {"num_kv_shared_layers": 5},  # of 11: the first 6 hold both layer types
    "bamba": {"attn_layer_indices": [1]},  # its defaults: no attention layer at all
    "granitemoehybrid": {"num_hidden_layers": 2,  # same
                         "layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},  # None fails
    "recurrent_gemma": {"num_hidden_layers": 3},  # its block cycle: 2 recurrent, 1 attention
    "zamba": {"num_hidden_layers": 5},  # fewer: its shared attention block cannot be tied
    "cohere_compass_text": {"num_hidden_layers": 2,  # rotary settings per layer type, or None
                            "layer_types": ["sliding_attention", "full_attention"],  # (NoPE)
                            "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                      "rope_theta": 1e4},
                                                "full_attention": None}},
    # transformers 5.23's DbrxAttention reads attn_config.rope_theta, which the config no longer
    # has, and clamps by clip_qkv, which defaults to None (DBRX's checkpoints: 8)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4}},
    "moshi": {"audio_vocab_size": 128},  # None unless an audio encoder config gives it
    "musicgen": {"num_codebooks": 1, "decoder_start_token_id": 1},  # a prompt's row: 1 codebook
    "musicgen_melody": {"num_codebooks": 1, "decoder_start_token_id": 1},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                  "indexer_budget": 64, "indexer_compress_ratio": 4},  # None: fails to build
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 64, "indexer_compress_ratio": 4},
    "xlstm": {"qk_dim_factor": 1.0},  # 0.5: its cache state is shaped for 1.0
    "xmod": {"default_language": "en_XX"},  # its language adapters need one
}
UNRUNNABLE = {  # families that cannot generate alone with a cache of their own, and why
    "gemma4_assistant": "Gemma 4's drafter: its forward requires `shared_kv_states`, the target "
                        "model's keys and values; it caches none of its own",
    "blt": "transformers 5.23 cannot generate with its cache: `DynamicCache(config)` reads "
           "`num_hidden_layers`, which BltConfig lacks, and its byte encoder, patch transformer "
           "and byte decoder number their layers from 0 into one cache",
}


class Skipped(Exception):
    """Not a decoder-only text model: the reason."""


def tiny_kwargs(config_cls, overrides: dict) -> dict:
    """The fields of ``SIZES`` and ``POSITIONS`` the class has, with its sub-configs' own, and
    the fewest layers that keep every per-layer pattern; then ``overrides``."""
    defaults = config_cls().to_dict()
    kwargs = {k: [v] * len(defaults[k]) if isinstance(defaults[k], list) else v
              for k, v in SIZES.items()
              if k in defaults and (k != "q_lora_rank" or defaults[k])}  # None: full-rank q
    kwargs |= {k: 512 for k in POSITIONS if isinstance(defaults.get(k), int) and defaults[k] < 512}
    if "kv_lora_rank" in kwargs:  # MLA: a key per query head; head_dim is RoPE's
        kwargs |= {k: v for k, v in (("num_key_value_heads", 4), ("head_dim", 8)) if k in kwargs}
    subs = getattr(config_cls, "sub_configs", {})
    kwargs |= {name: tiny_kwargs(sub, {}) for name, sub in subs.items()
               if isinstance(defaults.get(name), dict) and hasattr(sub, "sub_configs")}
    kwargs |= overrides
    key = next((k for k in LAYERS if k in defaults), None)
    if key is None or key in overrides:
        return kwargs
    probe = config_cls(**kwargs)
    count = defaults[key]
    patterns = {k: v for k, v in probe.to_dict().items()  # per layer, not layer indices
                if isinstance(v, list) and len(v) == count and len(set(map(str, v))) < count}
    kinds = lambda v: len(set(map(str, v)))
    layers = next((n for n in range(min(2, count), count + 1)
                   if all(kinds(v[:n]) == kinds(v) for v in patterns.values())), count)
    kwargs[key] = layers
    kwargs |= {k: [SIZES[k]] * layers if k in SIZES else v[:layers] for k, v in patterns.items()}
    return kwargs


def tiny_model(family: str):
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    config_cls = model_cls.config_class
    subs = sorted(getattr(config_cls, "sub_configs", {}))
    if family in UNRUNNABLE:
        raise Skipped(UNRUNNABLE[family])
    if "text_config" in subs:
        raise Skipped(f"multimodal: composite config ({', '.join(subs)})")
    if config_cls().is_encoder_decoder:
        raise Skipped("encoder-decoder config")
    torch.manual_seed(0)
    return model_cls(config_cls(**tiny_kwargs(config_cls, FAMILY.get(family, {})))).float().eval()


def prompts():
    """(short, long, (padded batch, its mask)): random ids from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(0)
    short, long = (torch.randint(3, 128, (1, n), generator=gen) for n in (SHORT, LONG))
    batch = torch.randint(3, 128, (2, SHORT), generator=gen)
    mask = torch.ones_like(batch)
    batch[1, :PAD], mask[1, :PAD] = 0, 0
    return short, long, (batch, mask)


def generate(model, ids, mask=None, new=NEW):
    import torch

    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, disable_compile=True, pad_token_id=0,
                              use_cache=True, return_dict_in_generate=True, num_return_sequences=1)  # MPT: off by default


def kv_bytes(cache) -> int:
    """Bytes of the keys and values a transformers cache holds (and an indexer's keys, which
    grow with them; and every floating tensor of a cache layer class a model defines for
    itself, as DeepSeek-V4's compressor states), each tensor once (DeepSeek-V4's values are its
    keys); a latent cache's own count."""
    if hasattr(cache, "cache_bytes"):
        return cache.cache_bytes()
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache: decoders with cross-attention
        return kv_bytes(cache.self_attention_cache) + kv_bytes(cache.cross_attention_cache)
    import torch

    from lorc_fx.cache import codes_own_states

    if not hasattr(cache, "layers"):
        held = getattr(cache, "key_cache", []) + getattr(cache, "value_cache", [])
    else:
        held = []
        for layer in cache.layers:
            held += [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
            if codes_own_states(type(layer)):
                held += [t for v in vars(layer).values()
                         for t in (v.values() if isinstance(v, dict) else (v,))
                         if isinstance(t, torch.Tensor) and t.is_floating_point()]
    unique = {id(t): t for t in held if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values())


def failure(err: BaseException) -> dict:
    lorc = [f for f in traceback.extract_tb(err.__traceback__) if "/lorc_fx/" in f.filename]
    where = (f"{'lorc_fx/' + lorc[-1].filename.rsplit('/lorc_fx/', 1)[1]}:{lorc[-1].lineno} "
             f"({lorc[-1].name})" if lorc else "outside lorc_fx")
    lines = str(err).strip().splitlines() or [""]
    message = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return {"error": type(err).__name__, "message": message[:300],
            "where": where}


def run_family(family: str, record_path: Path) -> None:
    """Steps 1-4 for one family, the record rewritten after each step."""
    import copy

    import torch
    import transformers

    import lorc_fx
    from lorc_fx.analysis.attention_match import MLA_REASON

    transformers.logging.set_verbosity_error()
    record = {"family": family}
    save = lambda: record_path.write_text(json.dumps(record, indent=1))
    short, long, (batch, mask) = prompts()
    record["step"] = "build"
    save()
    try:
        model = tiny_model(family)
        out = generate(model, short)
    except Skipped as why:
        record.update(status="skipped", reason=str(why))
        return save()
    except Exception as err:
        record.update(status="could not build/run", **failure(err))
        return save()
    cache = out.past_key_values
    layers = Counter(type(l).__name__ for l in getattr(cache, "layers", []))
    record.update(status="ran", model_class=type(model).__name__,
                  cache_class=type(cache).__name__, cache_layers=dict(layers),
                  kv_bytes=kv_bytes(cache) if cache is not None else 0, step="baseline")
    save()
    baseline = {}
    long_run = lambda m: generate(m, long)
    for name, run in (("long", lambda: long_run(model)),
                      ("batch", lambda: generate(model, batch, mask, EXACT_NEW))):
        try:
            baseline[name] = run()
        except Exception as err:
            record[f"uncompressed_{name}_failed"] = failure(err)
    held = getattr(getattr(baseline.get("long"), "past_key_values", None), "get_seq_length", None)
    if record["kv_bytes"] and held is not None and held() < LONG:  # MusicGen's prefills no prompt
        record["prompt_tokens_cached"] = cached = held() - (NEW - 1)
        record["long_new"] = new = LONG + NEW - cached  # 256 cached, as the others
        long_run = lambda m: generate(m, long, new=new)
        baseline["long"] = long_run(model)
    elif record["kv_bytes"] and held is not None and held() > LONG + NEW - 1:
        record["tokens_cached_besides"] = extra = held() - (LONG + NEW - 1)  # CPM-Ant's prompt
        shorter = long[:, extra:]  # 256 cached, as the others
        long_run = lambda m: generate(m, shorter)
        baseline["long"] = long_run(model)
    fresh, uncompressed = copy.deepcopy(model), copy.deepcopy(model)

    record["step"] = "default"
    save()
    default = record["default"] = {}
    try:
        report = lorc_fx.compress(model, progress=False)
        full, kept = report.cache_bytes_per_token()
        default.update(planned_fraction=kept / full if full else None,
                       left_alone=report.left_alone or None,
                       report=[l for l in str(report).splitlines()
                               if re.match(r"layers? \d|model left", l)])
        held = kv_bytes(generate(model, short).past_key_values)
        default["fraction"] = held / record["kv_bytes"] if record["kv_bytes"] else None
        if "long" in baseline and record["kv_bytes"]:
            held = kv_bytes(long_run(model).past_key_values)
            default["fraction_256"] = held / kv_bytes(baseline["long"].past_key_values)
    except Exception as err:
        default.update(failure(err))

    record["step"] = "full rank"
    save()
    if not record["kv_bytes"]:
        record["full_rank"] = "n/a: no keys and values cached"
    elif "batch" not in baseline:
        record["full_rank"] = "n/a: the uncompressed batch did not generate"
    else:
        try:
            report = lorc_fx.compress(fresh, cache_fraction=1.0, latent_bits=16, progress=False)
            got = generate(fresh, batch, mask, EXACT_NEW).sequences
            same = torch.equal(got, baseline["batch"].sequences)
            record["full_rank"] = (("equal" if same else "not equal")
                                   + (" (left alone)" if report.left_alone else ""))
        except Exception as err:
            record["full_rank"] = "error"
            record["full_rank_failure"] = failure(err)
        else:
            record["step"] = "full rank, compiled"
            save()
            try:
                record["full_rank_compiled"] = compiled_equal(fresh, batch, mask, baseline["batch"])
            except Exception as err:
                record["full_rank_compiled"] = "error"
                record["full_rank_compiled_failure"] = failure(err)
    if "batch" in baseline and any(MLA_REASON in line for line in default.get("report", [])):
        record["step"] = "MLA read absorbed"
        save()
        try:
            record["mla_absorbed"] = read_absorbed(uncompressed, batch, mask, baseline["batch"])
        except Exception as err:
            record["mla_absorbed"] = failure(err)
    record["step"] = "done"
    save()


def compiled_generate(model, batch, mask):
    """``model.forward`` compiled with ``lorc_backend``, its rewritten graphs run as they are
    (no Inductor, to keep the sweep short): the greedy tokens of step 4's ``generate`` and the
    backend's report of each graph."""
    import torch

    from lorc_fx.compile.backend import lorc_backend

    backend = lorc_backend.with_options(inductor=False)
    model.forward = torch.compile(model.forward, backend=backend)
    return generate(model, batch, mask, EXACT_NEW).sequences, backend.reports


def compiled_equal(model, batch, mask, expected) -> str:
    """Step 4's compressed model compiled (:func:`compiled_generate`): greedy tokens against
    the uncompressed model's, and the most attention calls (SDPA, or one of manual
    attention's two products) a graph read absorbed."""
    import torch

    got, reports = compiled_generate(model, batch, mask)
    absorbed = max((r.absorbed + r.counts.get("absorb_mla", 0) for r in reports), default=0)
    return (f"{'equal' if torch.equal(got, expected.sequences) else 'not equal'}, "
            f"{absorbed} absorbed a graph")


def read_absorbed(model, batch, mask, expected) -> dict:
    """Step 5: the uncompressed model compiled (:func:`compiled_generate`): greedy tokens
    against eager's, and the MLA blocks each graph read absorbed."""
    import torch

    got, reports = compiled_generate(model, batch, mask)
    return {"equal": torch.equal(got, expected.sequences),
            "absorbed_per_graph": [r.counts.get("absorb_mla", 0) for r in reports]}


def sweep(families: list[str], timeout: float) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory(prefix="lorc-families-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LORC_CACHE_DIR": f"{tmp}/lorc",
               "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "HF_HUB_OFFLINE": "1"}
        for family in families:
            path = Path(tmp) / f"{family}.json"
            start = time.monotonic()
            try:
                done = subprocess.run([sys.executable, __file__, "--family", family,
                                       "--record", str(path)], env=env, timeout=timeout,
                                      capture_output=True, text=True)
                crashed = done.returncode and (done.stderr.strip().splitlines() or ["?"])[-1]
            except subprocess.TimeoutExpired:
                crashed = f"timed out after {timeout:g} s"
            record = json.loads(path.read_text()) if path.exists() else {"family": family}
            if crashed:
                record["crashed"] = f"{crashed} (during {record.get('step', 'start')})"
                record.setdefault("status", "could not build/run")
            record["seconds"] = round(time.monotonic() - start, 1)
            records.append(record)
            print(summary(record), flush=True)
    return records


def has_kv(r: dict) -> bool:
    return r.get("status") == "ran" and bool(r.get("kv_bytes"))


def fraction(r: dict, key: str) -> str:
    value = r.get("default", {}).get(key)
    return "–" if value is None else f"{value:.3f}"


def failed(r: dict) -> str:
    """What failed and where, in a few words."""
    if r.get("status") == "skipped":
        return f"skipped: {r['reason']}"
    parts = []
    if r.get("status") == "could not build/run" and "error" in r:
        parts.append(f"could not build/run: {r['error']}: {r['message']}")
    for name in ("long", "batch"):
        if f"uncompressed_{name}_failed" in r:
            f = r[f"uncompressed_{name}_failed"]
            parts.append(f"uncompressed {name} generate: {f['error']}: {f['message']}")
    for label, f in (("default", r.get("default", {})), ("full rank", r.get("full_rank_failure")),
                     ("full rank, compiled", r.get("full_rank_compiled_failure"))):
        if f and "error" in f:
            parts.append(f"{label}: {f['error']}: {f['message'][:120]} @ {f['where']}")
    if r.get("crashed"):
        parts.append(r["crashed"])
    if "prompt_tokens_cached" in r:
        parts.append(f"its generate caches {r['prompt_tokens_cached']} of a prompt's {LONG} "
                     f"tokens: 256 cached after {r['long_new']} new")
    if "tokens_cached_besides" in r:
        extra = r["tokens_cached_besides"]
        parts.append(f"its generate caches {extra} tokens besides the prompt's: 256 cached "
                     f"after a prompt of {LONG - extra}")
    left_alone = r.get("default", {}).get("left_alone")
    if r.get("status") == "ran" and not r.get("kv_bytes"):
        parts.append("left alone: its cache holds no keys and values" if left_alone else
                     "cache holds no keys and values, yet lorc_fx planned it")
    elif left_alone:
        parts.append(f"default: left alone: {left_alone[:200]}")
    return "; ".join(parts).replace("|", "/")


def summary(r: dict) -> str:
    """The family's row of the table."""
    kv = "–" if r.get("status") != "ran" else ("yes" if r.get("kv_bytes") else "no")
    value = r.get("default", {}).get("fraction_256")
    goal = "–" if value is None or not has_kv(r) else ("yes" if value <= GOAL else "no")
    exact = r.get("full_rank", "–")
    if "full_rank_compiled" in r:
        exact += f"; compiled: {r['full_rank_compiled']}"
    absorbed = r.get("mla_absorbed")
    if absorbed is not None:
        exact += ("; compiled, MLA read absorbed: " + ("error" if "error" in absorbed else
                  f"{'equal' if absorbed['equal'] else 'not equal'}, "
                  f"{max(absorbed['absorbed_per_graph'], default=0)} blocks a graph"))
    return (f"| {r['family']} | {kv} | {fraction(r, 'fraction')} | {fraction(r, 'fraction_256')}"
            f" | {fraction(r, 'planned_fraction')} | {goal} | {exact} | {failed(r)} |")


def markdown(records: list[dict]) -> str:
    ran = [r for r in records if r.get("status") == "ran"]
    kv = [r for r in ran if has_kv(r)]
    below = lambda key: sum(1 for r in kv if (r.get("default", {}).get(key) or 9) <= GOAL)
    mla = [r for r in kv if "mla_absorbed" in r]
    lines = [
        "# lorc_fx over every transformers causal-LM family (`bench/families.py`)", "",
        "Tiny random float32 models from each config class's defaults (hidden 64, 4 heads, "
        "2 KV heads, head dim 16, vocab 128, the fewest layers keeping the layer pattern); "
        f"greedy `generate`, eager. Default options: `compress(model)`; fractions are the bytes "
        f"the compressed cache holds over the float32 cache of the same tokens (its keys, values "
        "and indexer keys, and every floating state of a cache layer class a model defines "
        "for itself, each tensor once), after a "
        f"{SHORT}-token prompt + {NEW} new (23 cached) and after a {LONG}-token prompt + {NEW} "
        f"new (256 cached), and as the report plans per token; ≤ {GOAL} is judged at 256 "
        f"tokens. Full rank: `compress(model, cache_fraction=1.0, latent_bits=16)`, "
        f"{EXACT_NEW} new tokens for a batch of 2, the second left-padded by {PAD}, against "
        "the uncompressed model. OMP_NUM_THREADS=1, 2 shared cores.", "",
        "| family | cache holds K/V? | default fraction (23 tok) | (256 tok) | planned | "
        f"≤ {GOAL}? | full-rank exact? | what failed and where |",
        "|---|---|---|---|---|---|---|---|",
        *(summary(r) for r in records), "",
        f"- families swept: {len(records)}; skipped: "
        f"{sum(r.get('status') == 'skipped' for r in records)}; could not build/run: "
        f"{sum(r.get('status') == 'could not build/run' for r in records)}; built and ran: "
        f"{len(ran)}",
        f"- caches holding keys and values: {len(kv)}",
        f"- default compression ≤ {GOAL}: {below('fraction_256')} of {len(kv)} at 256 tokens, "
        f"{below('fraction')} at 23 tokens, {below('planned_fraction')} as planned",
        f"- exact at full rank: {sum(r.get('full_rank') == 'equal' for r in kv)} of {len(kv)}, "
        f"and {sum(r.get('full_rank') == 'equal (left alone)' for r in kv)} left alone (not "
        f"equal: {sum(r.get('full_rank', '').startswith('not') for r in kv)}, error: "
        f"{sum(r.get('full_rank') == 'error' for r in kv)})",
        f"- full rank compiled with `lorc_backend` (rewritten graphs run as they are): "
        f"{sum(r.get('full_rank_compiled', '').startswith('equal') for r in kv)} of "
        f"{sum('full_rank_compiled' in r for r in kv)} token for token with the uncompressed "
        f"model (not equal: {sum(r.get('full_rank_compiled', '').startswith('not') for r in kv)}"
        f", error: {sum(r.get('full_rank_compiled') == 'error' for r in kv)})",
        f"- MLA (its cache already the latent) compiled with `lorc_backend`, read absorbed: "
        f"{len(mla)} families, {sum(bool(r['mla_absorbed'].get('equal')) for r in mla)} "
        "token for token with the eager model",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    parser.add_argument("--timeout", type=float, default=120, help="seconds per family")
    parser.add_argument("--out", type=Path, default=OUT, help="writes OUT.json and OUT.md")
    parser.add_argument("--update", action="store_true",
                        help="replace only the swept families' rows of OUT.json, keep the rest")
    parser.add_argument("--family", help=argparse.SUPPRESS)  # one family, in this process
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.family:
        return run_family(args.family, args.record)
    records = sweep(args.families, args.timeout)
    if args.update:
        swept = {r["family"]: r for r in records}
        kept = json.loads(Path(f"{args.out}.json").read_text())
        records = [swept.pop(r["family"], r) for r in kept] + list(swept.values())
    Path(f"{args.out}.json").write_text(json.dumps(records, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(markdown(records))


if __name__ == "__main__":
    main()
