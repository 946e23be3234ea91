"""One prefill writes every cache; an answer read through every plan's cache side by side in one
forward scores as the decode steps of ``generate`` would read each cache alone."""
import dataclasses

import pytest
import torch

import lorc_fx
from lorc_fx.analysis.cache_probe import fresh_cache
from lorc_fx.cache import LatentCache, angles_handed
from lorc_fx.data.retrieval_tasks import make_samples
from lorc_fx.search.one_prefill import (FULL, SideBySide, answer_logprobs, prefilled,
                                       reads_side_by_side, side_by_side, step)

from helpers.families import build, config_for


@pytest.fixture
def prompts_and_plan(loaded):
    model, tok, blocks, _ = loaded
    # answers of several tokens in the tiny model's vocabulary (its digits are one token)
    samples = [dataclasses.replace(s, answer="the grass is green")
               for s in make_samples(tok, "multikey", 160, 2, seed=3)]
    prompts = [(s.input_ids, s.answer_ids(tok)) for s in samples]
    assert all(len(answer) > 1 for _, answer in prompts)
    plans = {name: lorc_fx.compress(model, fraction, latent_bits=bits, rope="reconstruct",
                                    basis="weight", schedule="uniform", progress=False,
                                    blocks=blocks).plan
             for name, fraction, bits in (("plan", 0.5, 16), ("smaller", 0.25, 4))}
    return model, blocks, prompts, plans


def test_the_full_caches_answer_logprobs_are_one_forwards_and_a_plans_its_own(prompts_and_plan):
    model, blocks, prompts, plans = prompts_and_plan
    scores = answer_logprobs(model, prompts, {"plan": plans["plan"]}, blocks)
    for (ids, answer), full, compressed in zip(prompts, scores[FULL], scores["plan"],
                                               strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1]
        logp = logp.float().log_softmax(-1)
        assert full == pytest.approx(float(logp[torch.arange(len(answer)), answer].sum()),
                                     abs=1e-3)
        assert abs(compressed - full) > 1e-3  # the plan's cache is read


@torch.no_grad()
@pytest.mark.parametrize("name", ["plan", "smaller"])
def test_answers_read_side_by_side_score_as_decode_steps_read_each_cache(prompts_and_plan, name):
    model, blocks, prompts, plans = prompts_and_plan
    scores = answer_logprobs(model, prompts, plans, blocks)
    assert scores["plan"] != scores["smaller"]
    plan = plans[name]
    for (ids, answer), got in zip(prompts, scores[name], strict=True):
        logits, caches = prefilled(model, ids, {name: plan}, blocks)
        (_, cache, _), = [c for c in caches if c[0] == name]
        total = float(logits[0].log_softmax(-1)[answer[0]])
        with angles_handed(model, blocks, plan):
            for i, token in enumerate(answer[:-1]):
                logits = step(model, torch.tensor([[token]]), cache, len(ids) + i + 1)[:, -1]
                total += float(logits[0].float().log_softmax(-1)[answer[i + 1]])
        assert got == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen3_next", "falcon_h1", "zamba2"])
def test_transformers_caches_are_read_side_by_side_and_caches_of_a_models_own_class_not(family):
    # LFM2's convolution and Qwen3-Next's linear-attention states sit in transformers' cache
    # layers, one copy a row; Falcon-H1 and Zamba2 cache in classes of their own: the
    # retrieval probe declines them (said)
    assert reads_side_by_side(build(config_for(family))) == (family not in ("falcon_h1",
                                                                             "zamba2"))


@torch.no_grad()
@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_a_hybrids_answers_read_side_by_side_score_as_each_cache_read_alone(family):
    model = build(config_for(family, layers=4))
    blocks = lorc_fx.analyze(model)
    plans = {bits: lorc_fx.compress(model, fraction, latent_bits=bits, basis="weight",
                                    schedule="uniform", progress=False, blocks=blocks).plan
             for fraction, bits in ((0.75, 16), (0.6, 4))}
    generator = torch.Generator().manual_seed(0)
    ids, answer = (torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()
                   for n in (40, 4))
    scores = answer_logprobs(model, [(ids, answer)], plans, blocks)
    for name, plan in [(FULL, None), *plans.items()]:
        cache = fresh_cache(model) if plan is None else \
            LatentCache.from_cache(fresh_cache(model), plan)
        with angles_handed(model, blocks, plan):  # the prompt, then one token a step
            logits = model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
            total = float(logits.log_softmax(-1)[answer[0]])
            for i, token in enumerate(answer[:-1]):
                logits = step(model, torch.tensor([[token]]), cache, len(ids) + i + 1)[0, -1]
                total += float(logits.log_softmax(-1)[answer[i + 1]])
        assert scores[name] == [pytest.approx(total, abs=1e-4)]
    assert len({s[0] for s in scores.values()}) == 3  # each row reads its own cache


def test_what_would_act_on_the_first_cache_alone_is_refused(prompts_and_plan):
    model, blocks, prompts, plans = prompts_and_plan
    with side_by_side(model, prompts[0][0], plans, blocks) as (_, cache):
        assert isinstance(cache, SideBySide) and len(cache.caches) == 3
        for act in (lambda: cache.crop(-1), lambda: cache.reorder_cache(torch.tensor([0])),
                    lambda: cache.batch_select_indices(torch.tensor([0])), cache.reset):
            with pytest.raises(TypeError, match="crop, reorder or reset the caches themselves"):
                act()
