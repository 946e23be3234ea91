"""The retrieval answers' sensitivities: the answer tokens' loss gradient at the coded
positions, carried into the latent, times the channels' power; kept on disk; mixed into the
text's weights at a share of their total, keys apart from values."""
import logging

import pytest
import torch

import lorc_fx
from lorc_fx.plan.calibration import owner_module
from lorc_fx.plan.options import PlanOptions
from lorc_fx.search import answer_sensitivity as answers
from lorc_fx.search import codebooks
from helpers.tiny_llama import own_words


@pytest.fixture
def toy(loaded, monkeypatch):
    """The tiny model, its tokenizer and blocks, a plan of its pre-RoPE key and value latents,
    and two multikey prompts of the tokenizer's own words (it knows none of the prompts')."""
    model, tok, blocks, _ = loaded
    monkeypatch.setattr(answers, "PROMPTS", 2)
    monkeypatch.setattr(answers, "make_samples", own_words(answers.make_samples))
    plan = lorc_fx.compress(model, 0.5, rope="reconstruct", basis="weight", schedule="uniform",
                            progress=False, blocks=blocks).plan
    return model, tok, blocks, plan


def _direct_fisher(model, tok, blocks, plan, side, length, recent_divisor):
    """``F_c`` of ``side`` by autograd on the projection's output itself (its gradient
    retained), not through the recorder's added zeros."""
    block = {b.layer: b for b in blocks}[side[0]]
    layer = {l.layer: l for l in plan.layers}[side[0]]
    rebuild = getattr(layer, f"{side[1]}_rebuild").double()
    rows = torch.tensor(getattr(block, side[1]).row_index())
    module = model.get_submodule(owner_module(getattr(block, side[1]).weight))
    total = 0.0
    for sample in answers.make_samples(tok, answers.TASK, length, answers.PROMPTS, answers.SEED):
        ids, answer = sample.input_ids, sample.answer_ids(tok)
        kept = {}

        def retain(module, args, out):
            out.retain_grad()
            kept["out"] = out

        handle = module.register_forward_hook(retain)
        try:
            with torch.enable_grad():
                logits = model(torch.tensor([ids + answer]), use_cache=False).logits
                torch.nn.functional.cross_entropy(logits[0, len(ids) - 1:-1].float(),
                                                  torch.tensor(answer), reduction="sum").backward()
        finally:
            handle.remove()
        g = kept["out"].grad[0].index_select(-1, rows).double()
        coded = g[1:len(ids) - len(ids) // recent_divisor - 8]
        total = total + ((coded @ rebuild.T) ** 2).sum(0)
    return total / answers.PROMPTS


def test_the_answers_fisher_is_the_answer_losss_gradient_at_the_coded_positions(toy):
    model, tok, blocks, plan = toy
    length = answers.answer_length(model)
    assert length == 512  # the toy's context limit
    sides = [(plan.layers[0].layer, "k"), (plan.layers[-1].layer, "v")]
    fisher = answers.answer_fisher(model, tok, blocks, plan, sides, length, 64)
    for side in sides:
        direct = _direct_fisher(model, tok, blocks, plan, side, length, 64)
        assert fisher[side].shape == direct.shape and float(fisher[side].sum()) > 0
        torch.testing.assert_close(fisher[side], direct, rtol=1e-5, atol=1e-12)
    # a wider recent window leaves more positions out: less summed
    fewer = answers.answer_fisher(model, tok, blocks, plan, sides, length, 4)
    assert all(float(fewer[s].sum()) < float(fisher[s].sum()) for s in sides)


def test_the_answers_sensitivities_are_kept_and_read_back(toy, monkeypatch):
    model, tok, blocks, plan = toy
    windows = torch.randint(3, len(tok), (4, 64))
    measure = answers.answer_sensitivities
    calls = []
    monkeypatch.setattr(answers, "answer_sensitivities",
                        lambda *args: calls.append(args[-2]) or measure(*args))
    first = codebooks.kept_answer_sensitivities(model, tok, blocks, plan, windows, 256)
    again = codebooks.kept_answer_sensitivities(model, tok, blocks, plan, windows, 256)
    assert calls == [256] and first.keys() == again.keys() == set(codebooks.coded_sides(plan))
    assert all(torch.equal(first[s], again[s]) and (first[s] >= 0).all() for s in first)
    codebooks.kept_answer_sensitivities(model, tok, blocks, plan, windows, 128)
    assert calls == [256, 128]  # other prompts: measured


def test_answers_mix_in_at_a_share_of_the_texts_total_per_kind():
    text = {(0, "k"): torch.tensor([1.0, 3.0]), (1, "k"): torch.tensor([4.0, 0.0]),
            (0, "v"): torch.tensor([2.0, 2.0])}
    ans = {(0, "k"): torch.tensor([0.0, 1.0]), (1, "k"): torch.tensor([3.0, 0.0]),
           (0, "v"): torch.tensor([5.0, 0.0])}
    mixed = answers.with_answers(text, ans, 2.0)
    # keys: 8 of text, 4 of answers (scaled ×2, then ×2); values: 4 and 5 (×0.8, then ×2)
    assert torch.equal(mixed[0, "k"], torch.tensor([1.0, 7.0]))
    assert torch.equal(mixed[1, "k"], torch.tensor([16.0, 0.0]))
    assert torch.allclose(mixed[0, "v"], torch.tensor([10.0, 2.0]))
    assert all(torch.equal(answers.with_answers(text, ans, 0.0)[s], text[s]) for s in text)


def test_the_coded_positions_leave_out_the_sink_the_recent_window_and_the_last_block():
    assert answers.coded_positions(2048, 256) == slice(1, 2048 - 8 - 8)
    assert answers.coded_positions(2000, 256) == slice(1, 2000 - 7 - 8)
    assert answers.coded_positions(2048, 0) == slice(1, 2040)


def test_no_answers_are_measured_without_a_tokenizer_or_at_weight_zero(toy, monkeypatch,
                                                                        caplog):
    from lorc_fx.schemes import vector

    model, tok, blocks, plan = toy
    monkeypatch.setattr(vector, "kept_answer_sensitivities",
                        lambda *a: pytest.fail("measured the answers"))
    text = {side: torch.ones(4) for side in codebooks.coded_sides(plan)}
    off = PlanOptions(bits_per_value=2.0, answer_weight=0)
    on = PlanOptions(bits_per_value=2.0)
    with caplog.at_level(logging.WARNING, logger="lorc_fx"):
        assert vector.retrieval_answers(model, tok, blocks, plan, None, off, text) is None
        assert not caplog.records  # nothing to say
        assert vector.retrieval_answers(model, None, blocks, plan, None, on, text) is None
        assert vector.retrieval_answers(model, tok, blocks, plan, None, on, None) is None
    said = [r.getMessage() for r in caplog.records]
    assert "no tokenizer" in said[0] and "not linear in their projections" in said[1]
