"""``compress`` on models it cannot compress: a report that says why, never a traceback;
bad options refused before the model is traced. (Models whose attention the analysis
declines but whose transformers cache holds keys and values are stored as plain codes:
tests/api/test_without_graph.py.)"""
import logging
import re

import pytest
import torch
from torch import nn

import lorc_fx
from helpers.families import build, config_for


class EmbeddingLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def _llama_without_layers():
    config = config_for("llama")
    config.num_hidden_layers = 0
    return build(config)


@pytest.mark.parametrize("make, why", [
    (_llama_without_layers, "its traced forward holds no attention"),
    (EmbeddingLinear, "its traced forward holds no attention"),
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
     "cannot make token ids for Sequential"),
])
def test_a_model_without_attention_is_left_unchanged_with_a_reason(make, why, caplog):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="lorc_fx.api"):
        report = lorc_fx.compress(model, 0.6)
    assert report.plan is None and why in report.left_alone
    assert why in str(report) and report.cache_bytes_per_token() == (0, 0)
    assert [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert not hasattr(model, "_lorc_plan")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plan_of_a_model_without_attention_raises_a_clear_error():
    with pytest.raises(lorc_fx.NoAttentionFound, match="no attention to compress in"):
        lorc_fx.plan(_llama_without_layers(), 0.6)


@pytest.mark.parametrize("options, message", [
    (dict(cache_fraction=True), "cache_fraction must be a number"),
    (dict(cache_fraction=0.0), "cache_fraction must be a number in (0, 1]"),
    (dict(rank_multiple=2.5), "rank_multiple must be an integer >= 1, got 2.5"),
    (dict(rope="sideways"), "unknown rope mode 'sideways'"),
    (dict(cache_fraction=0.5, bits_per_value=4), "give cache_fraction or bits_per_value, not both"),
    (dict(bits_per_value=0.25), "bits_per_value must be a number in [0.5, 16]"),
    (dict(bits_per_value=4, latent_bits=8.0), "latent_bits must be one of [16, 8, 4, 'auto']"),
    (dict(latent_bits="best"), "latent_bits must be one of [16, 8, 4, 'auto'], got 'best'"),
    (dict(latent_bits=4, latent_group=3), "latent_group must be a positive integer"),
    (dict(bits_per_value=2, retrieval_weight=0.5), "retrieval_weight must be a number >= 1"),
    (dict(bits_per_value=2, answer_weight=-1), "answer_weight must be a number >= 0, got -1"),
])
def test_bad_options_fail_before_the_model_is_traced(options, message):
    class Untraceable(nn.Module):  # tracing it would fail with another message
        def forward(self, input_ids):
            raise AssertionError("traced")

    model = Untraceable()
    model.p = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=re.escape(message)):
        lorc_fx.compress(model, **options)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shards=2, basis="attention"), "basis='attention' has no per-shard form"),
    (dict(shards=2, rope="reconstruct"), "rope='reconstruct' has no per-shard form"),
    (dict(shards=0), "shards must be an integer >= 1"),
])
def test_per_shard_options_without_a_per_shard_form_are_refused_before_tracing(kwargs, message,
                                                                                 monkeypatch):
    monkeypatch.setattr(lorc_fx.api, "analyze", lambda *a, **k: pytest.fail("traced"))
    with pytest.raises(ValueError, match=re.escape(message)):
        lorc_fx.compress(build(config_for("llama")), 0.6, **kwargs)


def test_shards_that_do_not_divide_the_kv_heads_are_refused():
    model = build(config_for("llama", heads=4, kv_heads=2))
    with pytest.raises(ValueError, match=r"shards=3 does not divide the 2 KV heads of layer 0"):
        lorc_fx.compress(model, 0.6, basis="weight", shards=3)
