"""One tensor-parallel process (run under ``torchrun --nproc-per-node N``, gloo, CPU): loads
a model directory with ``tp_plan="auto"``, generates greedily uncompressed and then
compressed at each fraction (``--basis``, default "weight"), and rank 0 writes what every rank saw to a
JSON file. ``tests/api/test_tensor_parallel.py`` compares it with single-process runs.
(One model per launch: a second ``tp_plan`` model loaded in the same processes hung.)"""
from __future__ import annotations

import argparse
import json
import logging

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import lorc_fx
from lorc_fx.plan.options import CalibrationOptions

# a small calibration (text sampled from the model) for the data-aware bases
CALIBRATION = CalibrationOptions(tokens=512, window=64, seed=11)
PROMPT = [[1, 5, 9, 14, 20, 7, 30]]
NEW_TOKENS = 10


def generate(model) -> tuple[list[int], int, int]:
    """(tokens, bytes the cache's tensors hold, tokens cached)."""
    out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    held = cache.cache_bytes() if hasattr(cache, "cache_bytes") else None
    return out.sequences[0].tolist(), held, cache.get_seq_length()


def compress(model, fraction: float, basis: str, **kwargs):
    calibration = {} if basis == "weight" else {"calibration": CALIBRATION}
    return lorc_fx.compress(model, cache_fraction=fraction, basis=basis, **calibration, **kwargs)


def run(directory: str, fractions: list[float], compiled: bool, basis: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval()
    result = {"uncompressed": generate(model)[0], "fractions": {}}
    for fraction in fractions:
        report = compress(model, fraction, basis)
        tokens, held, cached = generate(model)
        entry = {"tokens": tokens, "cache_bytes": held, "cached_tokens": cached,
                 "bytes_per_token": report.cache_bytes_per_token(),
                 "bytes_per_token_per_shard": report.cache_bytes_per_token_per_shard(),
                 "ranks": [(l.k_rank, l.v_rank) for l in report.plan.layers],
                 "shards": report.plan.options.shards, "report": str(report)}
        if compiled:
            model.compile(backend=lorc_fx.lorc_backend)
            entry["compiled_tokens"] = generate(model)[0]
        result["fractions"][str(fraction)] = entry
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("model")
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--basis", default="weight")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mine = run(args.model, args.fractions, args.compile, args.basis)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
