"""Which layers retrieval leans on, measured: each layer's codes alone, read by the answers of
multikey prompts.

A plan that spends its bits where the held-out loss says can still lose what a long context
is read for: on the default model at 2.56 bits the vector plan finds 54 keys of 100 multikey
prompts where the full cache finds 62, almost all of its misses another key's number
(docs/retrieval.md). The loss is not spread over the layers: coding one layer alone (every
other layer's latents kept as floats) moves the answer's log-probability by 0.07-0.26 nats
for four layers of 30 and by at most 0.04 for any other (bench/results/retrieval_layers-cpu.md),
and neither the attention patterns (an induction score puts layer 17 in and 19 out) nor the
loss's gradients on the answers (layers 18 and 23 only) find the four.

So the probe measures it: ``PROMPTS`` multikey prompts (``data.retrieval_tasks``) of its own
seed, never an evaluation's, and never of the held-out family (vartrack); one prefill writes
the full cache and one cache per coded layer of the plan, that layer alone coded and every
other layer's keys and values as they came (``search.one_prefill``); each reads the answer as
decode steps would. A layer's damage is the mean absolute change of the answer's
log-probability against the full cache's; the layers above ``OUTLIER`` times the mean are the
ones the vector codes' allocation then weighs ``PlanOptions.retrieval_weight`` times more
(``schemes.vector``). What it measures is kept beside the calibration, keyed by the plan
probed: a later plan of the same budget reads it.
"""
from __future__ import annotations

import json
import logging
import statistics
from dataclasses import replace

from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.data.retrieval_tasks import make_samples
from lorc_fx.plan.calibration import calibration_file, save_atomic, write_json
from lorc_fx.plan.plan_file import plan_digest
from lorc_fx.plan.planner import Plan

from .one_prefill import FULL, answer_logprobs, prompt_length

TASK = "multikey"
SEED = "planner"  # evaluations draw integer seeds: the probe's prompts are none of theirs
PROMPTS = 8
LENGTH = 512  # tokens of prompt and answer (the model's context limit where shorter)
OUTLIER = 2.0  # a layer retrieval leans on moves the answers this many times the mean or more

log = logging.getLogger(__name__)


def coded_only(plan: Plan, layers: set[int]) -> Plan:
    """``plan`` with every layer not in ``layers`` (their positions in ``plan.layers``) left
    out (``skipped``): those layers cache their keys and values as they came, so a cache of
    one coded layer rebuilds one layer's keys a step, not every layer's."""
    return replace(plan, layers=[l if i in layers else replace(l, skipped=True)
                                 for i, l in enumerate(plan.layers)])


def one_layer_coded(plan: Plan) -> dict[str, Plan]:
    """Per coded layer (``"layer L"``), ``plan`` with that layer alone (``coded_only``)."""
    coded = [i for i, l in enumerate(plan.layers)
             if not l.skipped and (l.k_code is not None or l.v_code is not None)]
    return {f"layer {plan.layers[i].layer}": coded_only(plan, {i}) for i in coded}


def probe_length(model: nn.Module) -> int | None:
    """The probe's prompt length for ``model`` (:func:`~.one_prefill.prompt_length` of
    ``LENGTH``)."""
    return prompt_length(model, LENGTH)


def layer_damage(model: nn.Module, tokenizer, blocks: list[AttentionBlock], plan: Plan,
                 length: int = LENGTH) -> dict[int, float]:
    """Per coded layer of ``plan``, the mean absolute change of the answers' log-probability
    (nats) when only that layer is coded, against the full cache (shows progress)."""
    variants = one_layer_coded(plan)
    samples = make_samples(tokenizer, TASK, length, PROMPTS, SEED)
    prompts = [(s.input_ids, s.answer_ids(tokenizer)) for s in samples]
    scores: dict[str, list[float]] = {name: [] for name in [FULL, *variants]}
    for prompt in tqdm(prompts, desc="lorc: which layers retrieval leans on (multikey answers, "
                       "one layer coded at a time)", unit="prompt", mininterval=1.0):
        for name, logprobs in answer_logprobs(model, [prompt], variants, blocks).items():
            scores[name] += logprobs
    base = scores.pop(FULL)
    return {int(name.split()[-1]): statistics.mean(abs(v - b) for v, b in zip(values, base))
            for name, values in scores.items()}


def kept_layer_damage(model: nn.Module, tokenizer, blocks: list[AttentionBlock], plan: Plan,
                      length: int = LENGTH) -> dict[int, float]:
    """:func:`layer_damage`, read from the cache directory where this plan was probed before
    at ``length`` (``calibration/retrieval-*.json``, keyed by ``plan_digest`` and the
    probe's prompts), else measured and kept there."""
    # format 2: the other layers as they came (1 kept their latents as floats)
    path = calibration_file("retrieval-", {"format": 2, "plan": plan_digest(plan), "task": TASK,
                                           "seed": SEED, "prompts": PROMPTS, "length": length},
                            ".json")
    if path.is_file():
        return {int(layer): d for layer, d in json.loads(path.read_text()).items()}
    damage = layer_damage(model, tokenizer, blocks, plan, length)
    save_atomic(damage, path, write=write_json)
    log.info("vector codes: the retrieval probe's measurements kept in %s", path)
    return damage


def retrieval_layers(damage: dict[int, float]) -> list[int]:
    """The layers whose damage is above ``OUTLIER`` times the mean, in order."""
    if not damage:
        return []
    mean = statistics.mean(damage.values())
    return sorted(layer for layer, d in damage.items() if d > OUTLIER * mean > 0)
