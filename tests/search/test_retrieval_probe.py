"""The retrieval probe codes one layer at a time and measures how far that moves the answers:
coarser codes move them further, layers without codes are not probed, and the layers it
returns are the outliers."""
from dataclasses import replace

import pytest

import lorc_fx
from lorc_fx.cache.latent_cache import codecs
from lorc_fx.codes.integer import QuantSpec
from lorc_fx.search import retrieval_probe
from helpers.tiny_llama import own_words


def _at_bits(plan, bits: int):
    """``plan`` with every code at ``bits`` (the same groups and axes)."""
    def code(c):
        return None if c is None else replace(c, bits=bits)
    return replace(plan, layers=[replace(l, k_code=code(l.k_code), v_code=code(l.v_code))
                                 for l in plan.layers])


@pytest.fixture
def int4_plan(loaded):
    model, _, blocks, _ = loaded
    plan = lorc_fx.compress(model, 0.5, latent_bits=4, rope="reconstruct", basis="weight",
                            schedule="uniform", progress=False, blocks=blocks).plan
    assert all(isinstance(l.k_code, QuantSpec) and l.k_code.bits == 4 for l in plan.layers)
    return plan


def test_coarser_codes_move_the_answers_further_layer_by_layer(loaded, int4_plan,
                                                               monkeypatch):
    monkeypatch.setattr(retrieval_probe, "PROMPTS", 3)
    # prompts of the tiny tokenizer's own words, at the probe's length
    monkeypatch.setattr(retrieval_probe, "make_samples", own_words(retrieval_probe.make_samples))
    model, tok, blocks, _ = loaded
    length = retrieval_probe.probe_length(model)
    coarse = retrieval_probe.layer_damage(model, tok, blocks, _at_bits(int4_plan, 2), length)
    fine = retrieval_probe.layer_damage(model, tok, blocks, _at_bits(int4_plan, 8), length)
    assert coarse.keys() == fine.keys() == {l.layer for l in int4_plan.layers}
    assert all(coarse[l] > fine[l] >= 0 for l in coarse)

    alone = retrieval_probe.coded_only(int4_plan, {1})  # layer 0 left out: not probed
    assert codecs(alone).keys() == {int4_plan.layers[1].layer}  # its cache: the full one's
    assert retrieval_probe.layer_damage(model, tok, blocks, alone, length).keys() == {
        int4_plan.layers[1].layer}


def test_the_layers_retrieval_leans_on_are_above_twice_the_mean():
    damage = {0: 0.003, 1: 0.26, 2: 0.005, 3: 0.1, 4: 0.04, 5: 0.0}
    # twice the mean is 0.136: layer 3's 0.1 falls short, its 0.2 does not
    assert retrieval_probe.retrieval_layers(damage) == [1]
    assert retrieval_probe.retrieval_layers({**damage, 3: 0.2}) == [1, 3]
    assert retrieval_probe.retrieval_layers({0: 0.0, 1: 0.0}) == []
    assert retrieval_probe.retrieval_layers({}) == []


def test_what_the_probe_measured_of_a_plan_is_kept_and_read_back(loaded, int4_plan,
                                                                 monkeypatch):
    model, tok, blocks, _ = loaded
    measured = []

    def measure(model, tokenizer, blocks, plan, length):
        measured.append(plan)
        return {l.layer: 0.1 * (i + 1) + plan.layers[0].k_code.bits for i, l in
                enumerate(plan.layers)}

    monkeypatch.setattr(retrieval_probe, "layer_damage", measure)
    first = retrieval_probe.kept_layer_damage(model, tok, blocks, int4_plan, 256)
    assert retrieval_probe.kept_layer_damage(model, tok, blocks, int4_plan, 256) == first
    assert len(measured) == 1  # read back, with its layers as integers
    coarser = retrieval_probe.kept_layer_damage(model, tok, blocks, _at_bits(int4_plan, 2), 256)
    retrieval_probe.kept_layer_damage(model, tok, blocks, int4_plan, 128)
    assert len(measured) == 3 and coarser != first  # another plan, another length: measured
