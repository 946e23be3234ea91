"""Compiled decode of an MLA model (DeepSeek-V3's attention shapes, random weights) with
transformers' per-step expansion of the cached latent (``model.compile()``) against the same
model read absorbed (``model.compile(backend=lorc_backend)``: ``compile.passes.absorb_mla``),
and read absorbed from int8 codes (``lorc_fx.compress(model)`` first, default options: plain
codes of the latent and the RoPE key), the three in ONE process, their ``generate`` calls
alternated round by round.

    OMP_NUM_THREADS=1 python bench/mla_decode.py --context 4096 --heads 16

The attention is DeepSeek-V3's per head (latent 512 wide, RoPE key 64, key 128 + 64, value
128, query latent 1536); ``--heads`` (DeepSeek-V3: 128) and the rest of the model are cut to
fit a 2-core machine. A step's time is the median of its steps after ``--warmup-steps``
(stamped as bench/decode_ab.py does); the two float models must give the same greedy tokens
(the coded one is reported). Prints
the cache bytes a token of each reading holds or builds and appends the record to
bench/results/mla_decode-cpu.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402

from decode_ab import alternated, decode_steps  # noqa: E402
import lorc_fx  # noqa: E402
from lorc_fx.compile.backend import lorc_backend  # noqa: E402

OUT = Path(__file__).parent / "results" / "mla_decode-cpu.jsonl"
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
           q_lora_rank=1536)  # DeepSeek-V3's attention, per head


def mla_model(heads: int, layers: int, hidden: int) -> torch.nn.Module:
    config = DeepseekV3Config(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden,
                              num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads, first_k_dense_replace=layers,
                              n_routed_experts=2, num_experts_per_tok=1, n_group=1,
                              topk_group=1, moe_intermediate_size=64,
                              max_position_embeddings=16384, **MLA)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def bytes_per_token(config, heads: int) -> dict:
    """What one token costs each reading, float32, every layer: the latent and RoPE key the
    cache holds, and the per-head keys and values the expansion builds every step."""
    per_layer = {"cached latent + RoPE key": config.kv_lora_rank + config.qk_rope_head_dim,
                 "per-head keys + values": heads * (config.qk_nope_head_dim
                                                    + config.qk_rope_head_dim
                                                    + config.v_head_dim)}
    return {k: 4 * v * config.num_hidden_layers for k, v in per_layer.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ids = torch.randint(3, 1024, (1, args.context), generator=torch.Generator().manual_seed(0))

    # three models share transformers' forward code: room for all their graphs in Dynamo's
    # cache of it (8 entries by default; past it, the timed calls recompiled)
    torch._dynamo.config.recompile_limit = 64
    variants, coded = {}, None
    for name, backend in (("expanded", "inductor"), ("absorbed", lorc_backend),
                          ("absorbed, int8 codes", lorc_backend)):
        model = mla_model(args.heads, args.layers, args.hidden)
        if name.endswith("codes"):  # plain codes of the latent and RoPE key, default options
            coded = lorc_fx.compress(model, progress=False)
        model.compile(backend=backend)
        decode_steps(model, ids, args.new_tokens, "none", args.warmup_steps)  # compiles
        variants[name] = model
    for model in variants.values():  # an untimed round: the first two compiled again once the
        decode_steps(model, ids, args.new_tokens, "none", args.warmup_steps)  # third had run
    absorbed = sum(r.counts.get("absorb_mla", 0) for r in lorc_backend.reports)
    tokens = {}

    def timed(name: str) -> float:
        step, tokens[name] = decode_steps(variants[name], ids, args.new_tokens, "none",
                                          args.warmup_steps)
        return step

    ms = alternated({name: partial(timed, name) for name in variants}, args.rounds)
    same = torch.equal(tokens["expanded"], tokens["absorbed"])
    ratios = [e / a for e, a in zip(ms["expanded"], ms["absorbed"])]
    coded_ratios = [e / a for e, a in zip(ms["expanded"], ms["absorbed, int8 codes"])]
    config = variants["absorbed"].config
    record = {**vars(args), "mla": MLA, "attention_blocks_absorbed": absorbed,
              "same_tokens": same, "step_ms": ms, "round_ratios": ratios,
              "median_ratio": statistics.median(ratios),
              "codes": {"cache_fraction": coded.plan.cache_fraction,
                        "bits_per_value": coded.plan.bits_per_value,
                        "round_ratios": coded_ratios,
                        "median_ratio": statistics.median(coded_ratios),
                        "same_tokens_as_expanded": torch.equal(tokens["expanded"],
                                                               tokens["absorbed, int8 codes"])},
              "bytes_per_token": bytes_per_token(config, args.heads),
              "bytes_per_token_deepseek_v3": bytes_per_token(
                  DeepseekV3Config(num_hidden_layers=61, **MLA), 128),
              "threads": torch.get_num_threads(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "torch": torch.__version__,
              "loadavg_end": os.getloadavg()}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print("expanded ÷ absorbed per round: " + ", ".join(f"x{x:.2f}" for x in ratios)
          + f"; median x{statistics.median(ratios):.2f}; same greedy tokens: {same}; "
          f"attention blocks read absorbed: {absorbed} (graphs × layers)")
    print(f"with the cache as int8 codes ({coded.plan.cache_fraction:.3f} of its bytes): "
          f"expanded ÷ absorbed median x{statistics.median(coded_ratios):.2f}; same greedy "
          f"tokens: {record['codes']['same_tokens_as_expanded']}")
    for what, sizes in (("this model", record["bytes_per_token"]),
                        ("DeepSeek-V3 (128 heads, 61 layers)",
                         record["bytes_per_token_deepseek_v3"])):
        latent, expanded = sizes.values()
        print(f"{what}: a token's cached latent + RoPE key {latent} B, the per-head keys and "
              f"values built from it each step {expanded} B (x{expanded / latent:.0f})")


if __name__ == "__main__":
    main()
