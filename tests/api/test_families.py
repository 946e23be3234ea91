"""Current decoder families beyond classic dense attention, as a new user meets them:
``compress(model, cache_fraction=0.5)`` then ``generate`` on tiny random models built with
transformers' own classes (``helpers.families``). Each is compressed, or left unchanged with
the reason, or refused with the budget's reachable range: never a bare exception."""
import contextlib
import copy

import pytest
import torch
from transformers import MusicgenMelodyForCausalLM
from transformers.models.minimax.modeling_minimax import MiniMaxCache

import lorc_fx
from helpers.families import build, config_for
from helpers.pass_helpers import assert_same_generation, compiled, generate, prompt
from lorc_fx.cache import (LatentCache, LatentDynamicLayer, LatentSlidingLayer,
                          LatentStaticSlidingLayer)
from lorc_fx.cache.hybrid_layers import LatentHybridLayer, LatentIndexedLayer
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.attention_probe import AttentionProbe, attention_modules

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))


def _generate(model, **kwargs):
    return model.generate(PROMPT, max_new_tokens=6, do_sample=False, **kwargs)


def test_a_hybrid_models_attention_layers_are_compressed_beside_its_convolutions():
    """LFM2: a convolution layer, then attention. The attention block writes cache layer 1,
    not 0 (the analysis numbers blocks by the cache layer they write), so its layer is the
    one compressed and the convolution state is left as transformers keeps it."""
    model = build(config_for("lfm2"))
    report = lorc_fx.compress(model, 0.5, latent_bits=16, progress=False)
    assert [l.layer for l in report.plan.layers] == [1]
    out = _generate(model, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, LatentCache) and isinstance(cache.layers[1], LatentDynamicLayer)
    assert not isinstance(cache.layers[0], LatentDynamicLayer)
    full, kept = report.cache_bytes_per_token()
    assert kept <= 0.5 * full
    assert cache.cache_bytes() == kept * (out.sequences.shape[1] - 1)  # the last token: no step


@pytest.mark.parametrize("family", ["lfm2", "qwen3_next"])
def test_a_hybrid_model_at_full_rank_generates_as_before(family):
    """Qwen3-Next's attention output is gated before its projection (none is found): its
    module is the one owning the query, key and value projections."""
    model = build(config_for(family))
    before = _generate(model)
    report = lorc_fx.compress(model, 1.0, latent_bits=16, progress=False)
    assert [l.layer for l in report.plan.layers] == [1]
    assert torch.equal(_generate(model), before)


def test_a_hybrid_model_at_default_options_is_compressed():
    model = build(config_for("lfm2"))
    report = lorc_fx.compress(model, 0.5, progress=False)  # crashed: vector codes, no samples
    assert report.plan is not None and report.plan.cache_fraction <= 0.5
    _generate(model)


def test_a_decoder_whose_forward_builds_its_cache_gets_a_latent_one():
    """MusicGen-Melody's own ``generate`` prepares no cache and its forward builds an
    ``EncoderDecoderCache`` of full keys and values: the first step gets a latent cache
    instead, or the plan it reports would store nothing. Exact at full rank, eager and
    compiled; coded at default options."""
    torch.manual_seed(0)  # the auto class maps the composite config, not the decoder's
    model = MusicgenMelodyForCausalLM(config_for("musicgen_melody")).eval()
    ids, mask = prompt(batch=1, length=70)  # a whole group of 64 tokens coded
    expected = generate(model, ids, mask, num_return_sequences=1)  # its generate: None fails
    full_bytes = sum(t.numel() * t.element_size() for layer in
                     expected.past_key_values.self_attention_cache.layers
                     for t in (layer.keys, layer.values))
    exact = copy.deepcopy(model)
    lorc_fx.compress(exact, 1.0, latent_bits=16, progress=False)
    for backend in (None, lorc_backend.with_options(inductor=False)):
        with compiled(exact, backend) if backend else contextlib.nullcontext():
            got = generate(exact, ids, mask, num_return_sequences=1)
        assert isinstance(got.past_key_values, LatentCache)
        assert_same_generation(got, expected)
    report = lorc_fx.compress(model, progress=False)
    cache = generate(model, ids, mask, num_return_sequences=1).past_key_values
    assert isinstance(cache, LatentCache) and report.plan.cache_fraction <= 0.3
    assert cache.cache_bytes() < 0.5 * full_bytes


def _nanochat_rotate_half(x):
    """NanoChat's: ``cat(x2, -x1)``, each pair turned by -θ for the ``(cos, sin)`` it is given."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def test_rope_turned_the_other_way_is_rebuilt_with_its_own_sign(monkeypatch):
    """A Llama whose ``rotate_half`` is NanoChat's (pairs read as ``(t + 8, t)``) computes what
    the Llama with its query and key rows swapped by halves per head computes. Compressed
    with half the key rank, keys cached before RoPE and rebuilt (``basis='weight'``: the same
    bases up to that swap), the two still agree, eager and compiled; the angle log must hand
    back ``-sin`` for it (with ``sin``: 3e-3 apart)."""
    import transformers.models.llama.modeling_llama as llama

    normal = build(config_for("llama"))
    turned = copy.deepcopy(normal)
    head_dim = normal.config.head_dim
    swap = torch.cat([torch.arange(head_dim // 2, head_dim), torch.arange(head_dim // 2)])
    for layer in turned.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            w = proj.weight.data
            proj.weight.data = w.view(-1, head_dim, w.shape[1])[:, swap].reshape_as(w).clone()
    ids, mask = prompt(length=12)
    options = dict(basis="weight", rope="reconstruct", latent_bits=16, progress=False)
    lorc_fx.compress(normal, 0.5, **options)
    expected = generate(normal, ids, mask, new_tokens=4)
    monkeypatch.setattr(llama, "rotate_half", _nanochat_rotate_half)
    report = lorc_fx.compress(turned, 0.5, **options)
    assert {l.rope.turn for l in report.plan.layers} == {-1}
    assert all(l.k_latent_of == "pre_rope" and l.k_basis.shape[0] < 2 * head_dim
               for l in report.plan.layers)
    for backend in (None, lorc_backend.with_options(inductor=False)):
        with compiled(turned, backend) if backend else contextlib.nullcontext():
            got = generate(turned, ids, mask, new_tokens=4)
        assert isinstance(got.past_key_values, LatentCache)
        assert_same_generation(got, expected)


@pytest.mark.parametrize("family, rope", [("gemma2", "commute"), ("gpt_oss", "reconstruct"),
                                          ("bloom", "commute"), ("xglm", "commute")])
def test_manual_attention_is_exact_at_full_rank_eager_and_compiled(family, rope):
    """Eager attention: Gemma 2's softcap, gpt-oss's sinks, BLOOM's and XGLM's heads merged
    into the batch (``baddbmm`` adding ALiBi, ``bmm``). gpt-oss in ``reconstruct`` mode also
    proves its RoPE (halves rotated apart, tables of one value per pair, scaled by YaRN's
    ``attention_scaling``) turned back exactly. Compiled, a decode step reads both of each
    layer's products absorbed (what lies between them kept)."""
    model = build(config_for(family))
    ids, mask = prompt()
    expected = generate(model, ids, mask)
    report = lorc_fx.compress(model, 1.0, basis="weight", rope=rope, progress=False)
    assert not report.unsupported and len(report.plan.layers) == 2
    got = generate(model, ids, mask)
    assert isinstance(got.past_key_values, LatentCache)
    assert_same_generation(got, expected)
    backend = lorc_backend.with_options(inductor=False)
    with compiled(model, backend):
        got = generate(model, ids, mask)
    assert isinstance(got.past_key_values, LatentCache)
    assert_same_generation(got, expected)
    assert max(r.absorbed for r in backend.reports) == 2 * 2


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcapped_and_sink_attention_is_compressed_at_default_options(family):
    model = build(config_for(family))
    report = lorc_fx.compress(model, 0.5, progress=False)
    assert report.plan.cache_fraction <= 0.5
    out = _generate(model, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, LatentCache)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcapped_and_sink_attention_is_found_and_probed_as_the_model_runs_it(family):
    """Gemma 2 caps its scores (``cap · tanh(s / cap)``; a cap of 0.1 here, so that the cap
    shows), gpt-oss joins a learned sink logit per head to them and drops its probability:
    both act on the scores alone, so each block is matched, with what acts on its scores
    noted; and the calibration probe runs them as the model's own attention does."""
    config = config_for(family)
    config.attn_logit_softcapping = 0.1 if family == "gemma2" else None
    model = build(config)
    blocks = lorc_fx.analyze(model)
    assert [b.supported for b in blocks] == [True, True], [b.reason for b in blocks]
    assert blocks[0].rope_k.style == "half" and blocks[0].attention_op == "manual"
    if family == "gemma2":
        assert blocks[0].notes["softcap"] == 0.1 and blocks[0].scale == 256 ** -0.5
    else:
        assert blocks[0].notes["sinks"] == 1 and blocks[0].scale == 16 ** -0.5
    expected = model(PROMPT).logits
    with AttentionProbe(model, attention_modules(model, {b.layer: b.k.weight for b in blocks})):
        got = model(PROMPT).logits
    torch.testing.assert_close(got, expected)


SLIDING = [("gemma3_sliding", 6), ("qwen2_sliding", 2)]  # Gemma 3's 5:1 pattern; Qwen2 half


def _sliding_model(family, layers, window=None):
    config = config_for(family, layers=layers)
    if window is not None:
        config.sliding_window = window
    return build(config)


@pytest.mark.parametrize("family, layers", SLIDING)
def test_sliding_window_layers_at_full_precision_generate_as_before(family, layers):
    """Past the window (4 tokens; the prompt has 8): the sliding layers are lorc_fx's own,
    holding keys and values in full, and generate token for token as transformers' do,
    eager and (Qwen2 alone, for time) compiled."""
    model = _sliding_model(family, layers)
    expected = _generate(model)
    lorc_fx.compress(model, 1.0, progress=False)
    out = _generate(model, return_dict_in_generate=True)
    kinds = [type(l) for l in out.past_key_values.layers]
    assert LatentSlidingLayer in kinds and torch.equal(out.sequences, expected)
    if family == "qwen2_sliding":
        with compiled(model, lorc_backend.with_options(inductor=False)):
            assert torch.equal(_generate(model), expected)


@pytest.mark.parametrize("family, layers", SLIDING + [("gemma3_sliding", 2)])
def test_sliding_window_layers_store_codes_at_default_options(family, layers):
    """Every layer compresses (Gemma 3 was refused below 0.839 when its sliding layers stayed
    full; two layers: all sliding), and a context within the window (64 tokens, a window of
    128) holds exactly the bytes the report says; past the window the sliding layers hold
    it alone, and (Qwen2) a static cache holds them in a ring of codes, compiled as eager,
    within the window (decode reads the ring's first slots from their codes) and past it."""
    model = _sliding_model(family, layers, window=128)
    report = lorc_fx.compress(model, 0.3, progress=False)
    assert report.plan.cache_fraction <= 0.3
    assert all(l.k_code is not None and l.v_code is not None for l in report.plan.layers)
    said = [line for line in str(report).splitlines() if line.startswith("layer")]
    assert any("sliding_attention" in line and "keys int8" in line for line in said)
    ids = torch.randint(3, 90, (2, 64), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert LatentSlidingLayer in [type(l) for l in cache.layers]
    assert cache.cache_bytes() == report.cache_bytes_per_token()[1] * ids.numel()
    if family == "qwen2_sliding":  # a static ring while the window fills, its decode compiled
        static = model.generate(ids, max_new_tokens=2, do_sample=False,
                                cache_implementation="static")
        with compiled(model, lorc_backend.with_options(inductor=False)):
            assert torch.equal(model.generate(ids, max_new_tokens=2, do_sample=False,
                                              cache_implementation="static"), static)
    model.config.sliding_window = 4  # and past a window (the cache reads it from the config)
    out = _generate(model, return_dict_in_generate=True)
    sliding = [l for l in out.past_key_values.layers if isinstance(l, LatentSlidingLayer)]
    assert sliding and all(l.held() == 3 for l in sliding)
    if family == "qwen2_sliding":  # a static cache: sliding layers in a ring of codes
        static = _generate(model, cache_implementation="static", return_dict_in_generate=True)
        assert LatentStaticSlidingLayer in [type(l) for l in static.past_key_values.layers]
        backend = lorc_backend.with_options(inductor=False)
        with compiled(model, backend):
            assert torch.equal(_generate(model, cache_implementation="static"), static.sequences)
        # the decode step reads every layer from its codes, the ring's in the window's order
        assert [r.absorbed for r in backend.reports] == [0, layers]  # prefill: as computed


# hybrid layers (Mamba state and attention in one cache layer) and indexed ones (sparse
# attention's indexer keys beside the keys and values), and the cache class lorc_fx puts there
HYBRID = [("falcon_h1", 2, LatentHybridLayer), ("zamba2", 3, LatentHybridLayer),
          ("deepseek_v32", 2, LatentIndexedLayer)]


def _held_bytes(cache) -> int:
    """What transformers' cache holds that grows with the tokens: keys, values, indexer keys."""
    return sum(t.numel() * t.element_size() for l in cache.layers
               for t in (getattr(l, "keys", None), getattr(l, "values", None),
                         getattr(l, "indexer_keys", None)) if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("family, layers, latent", HYBRID)
def test_hybrid_and_indexed_cache_layers_store_codes_at_default_options(family, layers, latent):
    """Falcon-H1 (Mamba beside attention in every layer), Zamba2 (one attention block shared
    by the hybrid layers: its module's ``layer_idx`` is -1, so the cache layer it writes is
    read off transformers' cache) and DeepSeek-V3.2 (the analysis declines its MLA: plain
    codes, the indexer's keys coded too) were left unchanged: now each layer holding keys
    and values holds codes, in transformers' own layer class, and after 128 tokens (two
    groups of 64) the cache holds at most 0.3 of transformers' float32 cache."""
    model = build(config_for(family, layers=layers))
    ids = torch.randint(3, 90, (1, 128), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=1, do_sample=False,
                              return_dict_in_generate=True).past_key_values
    report = lorc_fx.compress(model, progress=False)
    assert report.plan is not None and report.plan.cache_fraction <= 0.3
    out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    coded = [i for i, l in enumerate(cache.layers) if isinstance(l, latent)]
    assert coded == [l.layer for l in report.plan.layers] and coded
    assert all(isinstance(cache.layers[i], type(expected.layers[i])) for i in coded)
    assert cache.cache_bytes() <= 0.3 * _held_bytes(expected)
    if latent is LatentHybridLayer:
        assert cache.cache_bytes() == report.cache_bytes_per_token()[1] * 128
        with pytest.raises(ValueError, match="no static latent counterpart yet"):
            _generate(model, cache_implementation="static")  # not a silent full cache


@pytest.mark.parametrize("family, layers", [("falcon_h1", 2), ("zamba2", 3)])
def test_hybrid_layers_at_full_rank_generate_as_before(family, layers):
    """Latents of full rank beside the Mamba state: greedy with a left-padded batch, and beam
    search (the beams reorder both halves of each layer), token for token as transformers'."""
    model = build(config_for(family, layers=layers))
    ids, mask = prompt()
    expected = generate(model, ids, mask)
    beams = _generate(model, num_beams=2)
    report = lorc_fx.compress(model, 1.0, latent_bits=16, progress=False)
    assert [l.layer for l in report.plan.layers] == [i for i in range(layers)
                                                     if family != "zamba2" or i == layers - 1]
    got = generate(model, ids, mask)
    assert LatentHybridLayer in [type(l) for l in got.past_key_values.layers]
    assert_same_generation(got, expected)
    assert torch.equal(_generate(model, num_beams=2), beams)
    if family == "falcon_h1":  # and compiled (the passes without Inductor, for time)
        with compiled(model, lorc_backend.with_options(inductor=False)):
            got = generate(model, ids, mask)
        assert LatentHybridLayer in [type(l) for l in got.past_key_values.layers]
        assert_same_generation(got, expected)


def test_a_model_caching_in_a_class_of_its_own_is_compressed_in_that_class():
    """MiniMax (attention beside lightning attention) refuses any cache but its own
    ``MiniMaxCache``, which keeps the linear attention's states beside ``DynamicCache``'s
    layers and adds the layers as they are written; ``generate`` builds none for it. It was
    left unchanged. Now its latent cache is a ``MiniMaxCache`` too, the attention layer
    latent: at full rank token for token as before, eager (a left-padded batch, beams) and
    compiled; at default options coded, with the bytes the plan counts."""
    model = build(config_for("minimax"))
    ids, mask = prompt()
    expected, beams = generate(model, ids, mask), _generate(model, num_beams=2)
    full = copy.deepcopy(model)
    report = lorc_fx.compress(full, 1.0, latent_bits=16, progress=False)
    assert [l.layer for l in report.plan.layers] == [0]
    got = generate(full, ids, mask)
    cache = got.past_key_values
    assert isinstance(cache, LatentCache) and isinstance(cache, MiniMaxCache)
    assert isinstance(cache.layers[0], LatentDynamicLayer)
    assert_same_generation(got, expected)
    assert torch.equal(_generate(full, num_beams=2), beams)
    with compiled(full, lorc_backend.with_options(inductor=False)):
        assert_same_generation(generate(full, ids, mask), expected)

    report = lorc_fx.compress(model, progress=False)
    assert report.plan.cache_fraction <= 0.3
    long = torch.randint(3, 90, (1, 128), generator=torch.Generator().manual_seed(0))
    out = model.generate(long, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values.cache_bytes() == report.cache_bytes_per_token()[1] * 128


def test_indexed_layers_of_a_plain_plan_generate_compiled_as_eager():
    """DeepSeek-V3.2 (declined MLA: plain codes, the indexer's keys coded too): compiled
    decode reads the codes as eager does, token for token."""
    model = build(config_for("deepseek_v32"))
    lorc_fx.compress(model, progress=False)
    ids, mask = prompt()
    eager = generate(model, ids, mask)
    assert isinstance(eager.past_key_values.layers[0], LatentIndexedLayer)
    with compiled(model, lorc_backend.with_options(inductor=False)):
        got = generate(model, ids, mask)
    assert torch.equal(got.sequences, eager.sequences)


def test_layers_reading_another_layers_cache_are_not_counted():
    """Gemma-3n's last layers read the keys and values of earlier ones (``num_kv_shared_layers``):
    transformers gives them a ``DummyLayer`` that holds nothing. The plan counted them as full
    layers kept (a tiny Gemma-3n: 0.548 planned, 0.172 held); now they are not planned and the
    report's bytes are the cache's."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=256,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=96, hidden_size_per_layer_input=16,
        activation_sparsity_pattern=[0.0] * 4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma3nForCausalLM(config).eval()
    report = lorc_fx.compress(model, progress=False)
    assert [l.layer for l in report.plan.layers] == [0, 1]
    ids = torch.randint(3, 90, (1, 128), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    assert out.past_key_values.cache_bytes() == report.cache_bytes_per_token()[1] * 128


def _assert_every_block_exact_at_full_rank_eager_and_compiled(model):
    """Both blocks of a two-layer ``model`` matched, and at full rank its greedy tokens (a
    left-padded batch) the uncompressed model's, eager and compiled."""
    ids, mask = prompt()
    expected = generate(model, ids, mask)
    report = lorc_fx.compress(model, 1.0, latent_bits=16, progress=False)
    assert not report.unsupported and len(report.plan.layers) == 2
    assert_same_generation(generate(model, ids, mask), expected)
    with compiled(model, lorc_backend.with_options(inductor=False)):
        assert_same_generation(generate(model, ids, mask), expected)


def test_a_floor_under_the_scores_is_matched_and_exact_at_full_rank_eager_and_compiled():
    """XGLM floors its scores at the dtype's minimum (``torch.max(scores, finfo.min)``):
    elementwise, after ``q·k``, so it was declined and is now matched like a mask."""
    from transformers import XGLMConfig, XGLMForCausalLM

    torch.manual_seed(0)
    model = XGLMForCausalLM(XGLMConfig(
        vocab_size=96, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    _assert_every_block_exact_at_full_rank_eager_and_compiled(model)


def test_a_query_scaled_per_token_is_matched_and_exact_at_full_rank_eager_and_compiled():
    """Ministral 3 (and Llama 4) scale the query by ``1 + β log(1 + ⌊pos / L⌋)`` per token
    (L set to 4 here, so that the scale shows): attention reads that query as it comes, so
    the block is matched (it was declined: "unrecognised ops (mul)")."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    config = Ministral3Config(vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.rope_parameters.update(original_max_position_embeddings=4, llama_4_scaling_beta=0.5)
    torch.manual_seed(0)
    model = Ministral3ForCausalLM(config).eval()
    _assert_every_block_exact_at_full_rank_eager_and_compiled(model)
