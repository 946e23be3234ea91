"""Issue #36: plain quantization needs no graph proof. Where the analysis declines a model's
attention (MLA, whose cache is already its latent; a forward dynamo cannot trace; a custom
eager attention it finds no attention in), ``compress`` at default options still codes what
transformers' cache holds, chosen by bits alone, and says per layer why nothing else is."""
import copy

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.models.minimax import modeling_minimax
from transformers.models.minimax.modeling_minimax import MiniMaxCache

import lorc_fx
from helpers.families import (build, config_for, custom_attention_llama,
                              llama_with_one_custom_attention_layer)
from helpers.pass_helpers import compiled
from lorc_fx.analysis.attention_match import MLA_REASON
from lorc_fx.cache import LatentCache, LatentDynamicLayer
from lorc_fx.cache.own_layers import is_coded
from lorc_fx.codes.rows import RowSpec
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.schedules import UnreachableFraction


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))


def _mla():
    return build(config_for("deepseek_v3"))


def _mla_untraceable():  # eager broadcasts the heads; dynamo's fake run does not
    config = config_for("deepseek_v3")
    config.num_key_value_heads = 2
    return build(config)


DECLINED = {  # model, and what the analysis says of it
    "mla": (_mla, MLA_REASON),
    "untraceable": (_mla_untraceable, "dynamo cannot trace DeepseekV3ForCausalLM"),
    "custom_attention": (custom_attention_llama, "its traced forward holds no attention"),
}
LONG = torch.randint(3, 90, (2, 70), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(DECLINED))
def test_declined_attention_is_stored_as_plain_int8_at_default_options(name):
    """Within 0.3 of the float32 cache, every layer coded, each saying why no low rank; a
    context of whole groups (64 tokens, batch 2) holds exactly the bytes the report says."""
    make, why = DECLINED[name]
    model = make()
    report = lorc_fx.compress(model, cache_fraction=0.3, progress=False)
    plan = report.plan
    assert plan is not None and plan.scheme.name == "plain" and plan.unproven
    assert plan.options.latent_bits == 8 and plan.options.latent_group == 64
    assert plan.cache_fraction <= 0.3 and len(plan.layers) == 2
    assert all(l.k_code is not None and l.v_code is not None for l in plan.layers)
    assert all("no low rank" in l.note for l in plan.layers)
    assert why in str(report) and "chosen by bits alone" in str(report)
    out = model.generate(LONG[:, :64], max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, LatentCache)
    assert all(isinstance(l, LatentDynamicLayer) for l in cache.layers)
    assert cache.cache_bytes() == report.cache_bytes_per_token()[1] * 64 * 2


def test_mla_stores_transformers_latent_as_codes_and_generates_compiled_as_eager():
    """transformers 5.23's DeepSeek-V3 already caches MLA's normalised latent (kv_lora_rank
    wide, in the keys' slot) and the shared RoPE key (in the values'): the plain plan codes
    both; compiled with the backend (the latent dequantized, then read absorbed:
    ``absorb_mla``), generate gives the eager tokens past a whole group of codes (70 tokens,
    G64)."""
    model = _mla()
    report = lorc_fx.compress(model, cache_fraction=0.3, progress=False)
    config = model.config
    layer = report.plan.layers[0]
    assert (layer.k_full, layer.v_full) == (config.kv_lora_rank, config.qk_rope_head_dim)
    eager = model.generate(LONG, max_new_tokens=4, do_sample=False)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        assert torch.equal(model.generate(LONG, max_new_tokens=4, do_sample=False), eager)
    assert all(r.counts["absorb_mla"] == 2 for r in backend.reports)


def _held_bytes(cache) -> int:
    """Bytes of every floating tensor a cache's layers hold (a dict's entries too), each once."""
    held = {id(t): t for layer in cache.layers for v in vars(layer).values()
            for t in (v.values() if isinstance(v, dict) else (v,))
            if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return sum(t.numel() * t.element_size() for t in held.values())


def test_a_models_own_cache_layers_hold_every_state_as_row_codes():
    """DeepSeek-V4's cache layers are classes of its own (a window whose keys are its values,
    beside compressors' pending tokens, pooled entries and an indexer's keys), its attention
    declined: at default options every state they hold is stored as 8-bit rows. After 70
    tokens (the window slid, entries pooled) the cache holds the plan's bits per value, and
    exactly the plan's fraction of what transformers' own cache holds for the same tokens;
    beam search runs on it (its reorder recodes rows read back: exact), and compiled with the
    backend (the graph left as it is) it gives the eager tokens."""
    model = build(config_for("deepseek_v4"))
    reference = copy.deepcopy(model)
    report = lorc_fx.compress(model, progress=False)
    plan = report.plan
    assert plan.unproven and plan.cache_fraction <= 0.3
    assert all(isinstance(l.k_code, RowSpec) and l.k_code == l.v_code for l in plan.layers)
    assert "its own cache layer (DeepseekV4CSACache)" in str(report)
    out = model.generate(LONG, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    full = reference.generate(LONG, max_new_tokens=4, do_sample=False,
                              return_dict_in_generate=True)
    cache = out.past_key_values
    assert all(is_coded(l) for l in cache.layers)
    assert cache.cache_bits() / cache.cached_values() == plan.bits_per_value
    assert cache.cache_bytes() == pytest.approx(_held_bytes(full.past_key_values)
                                                * plan.cache_fraction, rel=1e-12)
    beams = model.generate(LONG, max_new_tokens=3, num_beams=2, do_sample=False)
    assert beams.shape == (2, LONG.shape[1] + 3)
    with compiled(model, lorc_backend.with_options(inductor=False)):
        assert torch.equal(model.generate(LONG, max_new_tokens=4, do_sample=False), out.sequences)


@pytest.mark.parametrize("options, why", [
    (dict(cache_fraction=0.5, latent_bits=16), "latent_bits=16 asks for low rank"),
    (dict(cache_fraction=1.0), "keeps the whole cache"),
    (dict(max_ppl_increase=0.02), "max_ppl_increase measures candidates"),
])
def test_options_that_need_the_graph_leave_a_declined_model_unchanged(options, why):
    model = _mla()
    report = lorc_fx.compress(model, progress=False, **options)
    assert report.plan is None and why in report.left_alone
    assert MLA_REASON in report.left_alone
    assert not hasattr(model, "_lorc_plan")


def test_a_budget_below_plain_int4_is_refused_with_what_plain_codes_reach():
    with pytest.raises(UnreachableFraction, match=r"only plain codes store its cache, which "
                                                  r"reach \[0\.1[0-9]+, 1\]"):
        lorc_fx.compress(_mla(), cache_fraction=0.1, progress=False)


def test_plan_of_a_declined_model_is_plain_int4_where_int8_does_not_fit():
    plan = lorc_fx.plan(_mla(), cache_fraction=0.2, progress=False)
    assert plan.scheme.name == "plain" and plan.options.latent_bits == 4
    assert plan.cache_fraction <= 0.2


def test_a_saved_plan_of_a_declined_model_is_not_installed_but_said_why(tmp_path):
    report = lorc_fx.compress(_mla(), cache_fraction=0.3, progress=False)
    path = report.save(tmp_path / "mla.safetensors")
    model = _mla()
    again = lorc_fx.compress(model, plan=path, progress=False)
    assert again.plan is None and "a saved plan installs only on attention" in again.left_alone
    assert not hasattr(model, "_lorc_plan")


def test_a_layer_the_analysis_declines_beside_proven_ones_is_coded_by_a_plain_plan():
    """Layer 1 runs a custom attention the analysis finds nothing in; layer 0 is proven. The
    plain candidate codes both (measured as usual through the real cache), layer 1 saying
    why it has no low rank; the cache holds the bytes the report says."""
    model = llama_with_one_custom_attention_layer()
    assert [b.layer for b in lorc_fx.analyze(model) if b.supported] == [0]
    report = lorc_fx.compress(model, cache_fraction=0.3, progress=False)
    plan = report.plan
    assert plan.scheme.name == "plain" and [l.layer for l in plan.layers] == [0, 1]
    assert "no low rank" in plan.layers[1].note and "no low rank" not in plan.layers[0].note
    assert plan.cache_fraction <= 0.3 and not report.unsupported
    out = model.generate(LONG[:, :64], max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True)
    assert all(isinstance(l, LatentDynamicLayer) for l in out.past_key_values.layers)
    assert out.past_key_values.cache_bytes() == report.cache_bytes_per_token()[1] * 64 * 2


def _xlm():  # caches keys and values in a dict of its own: transformers' cache stays empty
    from transformers import XLMConfig, XLMWithLMHeadModel

    return XLMWithLMHeadModel(XLMConfig(vocab_size=96, emb_dim=64, n_layers=2, n_heads=4,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()


def test_a_cache_lorc_fx_cannot_replace_leaves_the_model_unchanged_and_says_why(caplog):
    """XLM's attention is found, but it never writes transformers' cache (a plan was made
    and reported, and nothing changed): left unchanged, with the reason."""
    why = "its cache holds no keys and values after a forward"
    model = _xlm()
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    report = lorc_fx.compress(model, progress=False)
    assert report.plan is None and why in report.left_alone
    assert any(why in r.getMessage() for r in caplog.records)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0),
                       expected)


class _OwnLayer(DynamicLayer):
    pass


class _OwnLayers(MiniMaxCache):
    """MiniMax's cache class adding layers of a class of its own: no latent counterpart."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = _OwnLayer


def test_a_cache_class_of_its_own_that_lorc_fx_cannot_build_leaves_the_model_unchanged(
        monkeypatch, caplog):
    monkeypatch.setattr(modeling_minimax, "MiniMaxCache", _OwnLayers)
    model = build(config_for("minimax"))
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    report = lorc_fx.compress(model, progress=False)
    assert report.plan is None and "class of its own (_OwnLayers)" in report.left_alone
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
