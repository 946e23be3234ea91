"""Attention discovery from dynamo graphs: transformers families, hand-written attention,
KV caches in the graph, graph breaks, and what must come out unsupported."""
from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

from helpers.analysis_toys import ToyGPT, ToyMLP
from lorc_fx.analysis import analyze
from lorc_fx.report import blocks_table, blocks_to_json
from lorc_fx.analysis.records import Projection, RopeLayout, named_params
from lorc_fx.analysis.attention_match import match_attention
from lorc_fx.analysis.head_layout import classify_pairs
from lorc_fx.analysis.capture import capture, synthetic_input_ids
from lorc_fx.analysis.fx_ops import op_name

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64, **IDS)


def hf_model(config_name: str, attn_implementation: str | None = None, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kw)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation).eval()


# family -> (config, kwargs, heads, kv heads, head dim, rope, k_path, weights per layer)
ATTN = "model.layers.{i}.self_attn"
FAMILIES = {
    "llama": ("LlamaConfig", DECODER, 4, 2, 8, RopeLayout("half", 8), "rope",
              {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "mistral": ("MistralConfig", dict(DECODER, sliding_window=4), 4, 2, 8,
                RopeLayout("half", 8), "rope", {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "qwen2": ("Qwen2Config", DECODER, 4, 2, 8, RopeLayout("half", 8), "rope",
              {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "phi3": ("Phi3Config", DECODER, 4, 2, 8, RopeLayout("half", 8), "rope",
             dict(q=f"{ATTN}.qkv_proj", k=f"{ATTN}.qkv_proj", v=f"{ATTN}.qkv_proj",
                  o=f"{ATTN}.o_proj")),
    "gpt_neox": ("GPTNeoXConfig",
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=64, rotary_pct=0.5),
                 4, 4, 8, RopeLayout("half", 4), "rope",
                 dict(q="gpt_neox.layers.{i}.attention.query_key_value",
                      k="gpt_neox.layers.{i}.attention.query_key_value",
                      v="gpt_neox.layers.{i}.attention.query_key_value",
                      o="gpt_neox.layers.{i}.attention.dense")),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64), 4, 4, 8,
             RopeLayout(), "none",
             dict(q="transformer.h.{i}.attn.c_attn", k="transformer.h.{i}.attn.c_attn",
                  v="transformer.h.{i}.attn.c_attn", o="transformer.h.{i}.attn.c_proj")),
    "opt": ("OPTConfig", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                              num_attention_heads=4, vocab_size=64, word_embed_proj_dim=32, **IDS),
            4, 4, 8, RopeLayout(), "none",
            dict(q="model.decoder.layers.{i}.self_attn.q_proj",
                 k="model.decoder.layers.{i}.self_attn.k_proj",
                 v="model.decoder.layers.{i}.self_attn.v_proj",
                 o="model.decoder.layers.{i}.self_attn.out_proj")),
    "gemma": ("GemmaConfig", dict(DECODER, head_dim=8), 4, 2, 8, RopeLayout("half", 8), "rope",
              {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "gemma3": ("Gemma3TextConfig", dict(DECODER, head_dim=8, sliding_window=4), 4, 2, 8,
               RopeLayout("half", 8), "norm", {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "qwen3": ("Qwen3Config", dict(DECODER, head_dim=8), 4, 2, 8, RopeLayout("half", 8), "norm",
              {p: f"{ATTN}.{p}_proj" for p in "qkvo"}),
    "falcon": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=64, multi_query=True, bias=True,
                                    new_decoder_architecture=False),
               4, 1, 8, RopeLayout("half", 8), "rope",
               dict(q="transformer.h.{i}.self_attention.query_key_value",
                    k="transformer.h.{i}.self_attention.query_key_value",
                    v="transformer.h.{i}.self_attention.query_key_value",
                    o="transformer.h.{i}.self_attention.dense")),
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=64), 4, 4, 8,
              RopeLayout(), "none",
              dict(q="transformer.h.{i}.self_attention.query_key_value",
                   k="transformer.h.{i}.self_attention.query_key_value",
                   v="transformer.h.{i}.self_attention.query_key_value",
                   o="transformer.h.{i}.self_attention.dense")),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, rotary_dim=4),
             4, 4, 8, RopeLayout("interleaved", 4), "rope",
             {p: f"transformer.h.{{i}}.attn.{p}_proj" for p in "qkv"}
             | dict(o="transformer.h.{i}.attn.out_proj")),
}
# Attention written out by hand (baddbmm + ALiBi, GPT-J's rotate_every_two): no SDPA call to
# spy on, so their rows are checked by layout only.
MANUAL = {"bloom", "gptj"}


def family_model(family: str, attn_implementation: str | None = None):
    config, kw = FAMILIES[family][:2]
    return hf_model(config, attn_implementation, **kw)


def recorded_attention_inputs(model, blocks):
    """Run ``model`` eagerly with every position 0 (RoPE becomes the identity) and record
    the inputs of each projection and the (q, k, v) each SDPA call receives."""
    inputs, calls, handles = {}, [], []
    for b in blocks:
        for p in (b.q, b.k, b.v):
            module = model.get_submodule(p.weight.rsplit(".", 1)[0])
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=p.weight: inputs.setdefault(name, args[0])))
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q, k, v))
        return sdpa(q, k, v, *args, **kwargs)

    ids = synthetic_input_ids(model)
    kwargs = dict(use_cache=False)
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.zeros_like(ids)
    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(ids, **kwargs)
    finally:
        F.scaled_dot_product_attention = sdpa
        for h in handles:
            h.remove()
    return inputs, calls


def heads_from(p: Projection, x, params, num_heads):
    y = F.linear(x, p.weight_tensor(params), p.bias_tensor(params))
    return y.view(*y.shape[:-1], num_heads, -1).transpose(1, 2)


def assert_projection_rows_exact(model, blocks, roles="qkv"):
    """q/k/v recomputed from the found weight rows equal what the attention received."""
    params = named_params(model)
    inputs, calls = recorded_attention_inputs(model, blocks)
    assert len(calls) == len(blocks)
    for b, actual in zip(blocks, calls):
        for role, proj, got in zip("qkv", (b.q, b.k, b.v), actual):
            if role not in roles:
                continue
            heads = b.num_heads if role == "q" else b.num_kv_heads
            want = heads_from(proj, inputs[proj.weight], params, heads)
            if role == "q":
                want = want * b.q_scale
            want = want.repeat_interleave(got.shape[1] // heads, dim=1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_family(family):
    config, kw, h, h_kv, d, rope, k_path, weights = FAMILIES[family]
    model = hf_model(config, **kw)
    blocks = analyze(model)
    assert [b.layer for b in blocks] == [0, 1]
    for i, b in enumerate(blocks):
        assert b.supported, b.reason
        assert (b.num_heads, b.num_kv_heads, b.head_dim) == (h, h_kv, d)
        assert b.rope_q == b.rope_k == rope
        assert b.k_path == k_path and b.v_path == "none"
        assert (b.attention_op == "manual") == (family in MANUAL)
        for role in "qkvo":
            assert getattr(b, role).weight == weights[role].format(i=i) + ".weight"
        assert b.q.width == h * d and b.k.width == b.v.width == h_kv * d
        assert b.o.width == kw.get("hidden_size", kw.get("n_embd"))
    if family not in MANUAL:
        # q/k RMSNorm (Gemma 3, Qwen 3): only v is a linear function of the weights
        assert_projection_rows_exact(model, blocks, roles="v" if k_path == "norm" else "qkv")


@pytest.mark.parametrize("family", ["gpt_neox", "bloom"])
def test_rows_interleaved_per_head(family):
    """query_key_value viewed as (b, s, heads, 3 * d): q, k, v alternate per head."""
    b = analyze(family_model(family))[0]
    d = 8
    for offset, p in zip((0, d, 2 * d), (b.q, b.k, b.v)):
        assert p.row_index() == [3 * d * h + offset + e for h in range(4) for e in range(d)]


def test_row_layouts_of_fused_projections():
    phi = analyze(family_model("phi3"))[0]
    assert [(p.start, p.stop, p.rows) for p in (phi.q, phi.k, phi.v)] == [
        (0, 32, None), (32, 48, None), (48, 64, None)]
    gpt2 = analyze(family_model("gpt2"))[0]
    assert all(p.transposed and p.bias == "transformer.h.0.attn.c_attn.bias"
               for p in (gpt2.q, gpt2.k, gpt2.v))
    assert (gpt2.k.start, gpt2.k.stop) == (32, 64)


def test_biases_and_scales():
    qwen = analyze(hf_model("Qwen2Config", **DECODER))[0]
    assert qwen.k.bias == "model.layers.0.self_attn.k_proj.bias" and qwen.o.bias is None
    llama = analyze(hf_model("LlamaConfig", **DECODER))[0]
    assert llama.scale == pytest.approx(8 ** -0.5) and llama.q_scale == 1.0
    opt = analyze(family_model("opt"))[0]
    assert opt.q_scale == pytest.approx(8 ** -0.5)  # q = linear * scaling, SDPA scale 1
    assert opt.scale == pytest.approx(8 ** -0.5)
    gemma3 = analyze(family_model("gemma3"))[0]
    assert gemma3.scale == pytest.approx(256 ** -0.5)  # query_pre_attn_scalar
    assert gemma3.q_path == "norm"


@pytest.mark.parametrize("config", ["LlamaConfig", "GPT2Config"])
def test_manual_attention_of_eager_transformers(config):
    kw = DECODER if config == "LlamaConfig" else FAMILIES["gpt2"][1]
    sdpa = analyze(hf_model(config, **kw))
    eager = analyze(hf_model(config, "eager", **kw))
    assert [b.attention_op for b in eager] == ["manual", "manual"]
    for a, b in zip(sdpa, eager):
        assert b.supported, b.reason
        assert (a.q, a.k, a.v, a.o, a.num_kv_heads, a.rope_k) == (b.q, b.k, b.v, b.o,
                                                                  b.num_kv_heads, b.rope_k)
        assert b.scale == pytest.approx(a.scale)


def _matches(model, inputs):
    captured = capture(model, inputs)
    return [m for call in captured.calls
            for m in match_attention(captured.graphs[call.graph].gm, call.param_names)]


def test_dynamic_cache_in_graph():
    model = hf_model("LlamaConfig", **DECODER)
    ids = synthetic_input_ids(model)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
    for inputs in (dict(input_ids=ids, use_cache=True),
                   dict(input_ids=ids[:, :1], past_key_values=past, use_cache=True)):
        matches = _matches(model, inputs)
        assert len(matches) == 2
        for i, m in enumerate(matches):
            assert m.supported, m.reason
            assert m.k.weight == f"model.layers.{i}.self_attn.k_proj.weight"
            g = m.nodes
            assert op_name(g.key_cache) == "cat" and g.key is g.key_cache
            assert g.key_states is g.k_rope.output and g.key_states in g.key_cache.all_input_nodes
            assert g.value_states in g.value_cache.all_input_nodes
            assert g.key_pre_rope is g.k_rope.input
            assert g.o_linear is not None and g.o_linear.args[0] is g.attn_output


def test_static_cache_written_in_place():
    model = hf_model("LlamaConfig", **DECODER)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    matches = _matches(model, dict(input_ids=synthetic_input_ids(model), past_key_values=cache,
                                   use_cache=True))
    assert len(matches) == 2
    for m in matches:
        assert m.supported, m.reason
        assert (m.num_heads, m.num_kv_heads, m.rope_k) == (4, 2, RopeLayout("half", 8))
        g = m.nodes
        assert op_name(g.key_cache) == "index_copy_" and g.key_cache.args[3] is g.key_states


TOYS = {
    "complex": (dict(heads=4, kv_heads=2, head_dim=8, rope="complex"),
                RopeLayout("interleaved", 8)),
    "complex-partial": (dict(heads=2, kv_heads=2, head_dim=8, rope="complex", rotary_dim=4),
                        RopeLayout("interleaved", 4)),
    "interleaved-fused": (dict(heads=4, kv_heads=4, head_dim=8, rope="interleaved",
                               rotary_dim=4, fused=True, bias=True),
                          RopeLayout("interleaved", 4)),
    "half-mqa-partial": (dict(heads=4, kv_heads=1, head_dim=8, rope="half", rotary_dim=6),
                         RopeLayout("half", 6)),
    "none": (dict(heads=4, kv_heads=2, head_dim=4), RopeLayout()),
}


@pytest.mark.parametrize("toy", TOYS)
def test_hand_written_attention(toy):
    kw, rope = TOYS[toy]
    torch.manual_seed(0)
    blocks = analyze(ToyGPT(dim=32, layers=2, **kw))
    h, h_kv, d = kw["heads"], kw["kv_heads"], kw["head_dim"]
    assert len(blocks) == 2
    for i, b in enumerate(blocks):
        assert b.supported, b.reason
        assert b.attention_op == "manual"
        assert (b.num_heads, b.num_kv_heads, b.head_dim) == (h, h_kv, d)
        assert b.rope_q == b.rope_k == rope
        assert b.scale == pytest.approx(d ** -0.5)
        assert b.k_path == ("none" if rope.style == "none" else "rope")
        prefix = f"blocks.{i}.attn"
        if kw.get("fused"):
            spans = [(0, h * d), (h * d, (h + h_kv) * d), ((h + h_kv) * d, (h + 2 * h_kv) * d)]
            assert [(p.weight, p.start, p.stop) for p in (b.q, b.k, b.v)] == [
                (f"{prefix}.qkv.weight", a, z) for a, z in spans]
            assert b.k.bias == f"{prefix}.qkv.bias"
        else:
            assert [(p.weight, p.start, p.stop) for p in (b.q, b.k, b.v)] == [
                (f"{prefix}.{r}.weight", 0, n * d) for r, n in zip("qkv", (h, h_kv, h_kv))]
        assert b.o == Projection(f"{prefix}.proj.weight", 0, 32, f"{prefix}.proj.bias"
                                 if kw.get("bias") else None)


def test_graph_reused_across_layers_keeps_each_layers_weights():
    torch.manual_seed(0)
    model = ToyGPT(dim=32, layers=3, graph_break=True, heads=4, kv_heads=2, head_dim=8,
                   rope="half")
    blocks = analyze(model)
    assert [b.k.weight for b in blocks] == [f"blocks.{i}.attn.k.weight" for i in range(3)]
    assert len({b.notes["graph"] for b in blocks}) == 1


def test_no_attention():
    assert analyze(ToyMLP()) == []


def test_unknown_op_on_keys_is_unsupported():
    torch.manual_seed(0)
    blocks = analyze(ToyGPT(dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, key_op="tanh"))
    (b,) = blocks
    assert not b.supported and b.k_path == "other" and "tanh" in b.reason
    assert b.k.weight == "blocks.0.attn.k.weight"  # still located, for the report


def test_keys_from_two_projections_are_unsupported():
    torch.manual_seed(0)
    (b,) = analyze(ToyGPT(dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, key_op="sum"))
    assert not b.supported and "several projected tensors" in b.reason and b.k is None


def test_table_and_json():
    blocks = analyze(family_model("gpt_neox")) + analyze(
        ToyGPT(dim=32, layers=1, heads=4, kv_heads=2, head_dim=8, key_op="tanh"))
    table = blocks_table(blocks)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["layer", "ok", "heads/kv/dim"] and len(lines) == 2 + 3
    assert "half/4" in lines[2] and "32 rows in 0:80" in lines[2] and "tanh" in lines[4]
    data = json.loads(json.dumps(blocks_to_json(blocks)))
    assert data[0]["k"]["rows"][:3] == [8, 9, 10] and data[0]["rope_k"] == {
        "style": "half", "rotary_dim": 4, "turn": 1}
    assert blocks_table([]).endswith("(no attention found)")


def test_projection_rows():
    w = torch.arange(12.0).view(6, 2)
    params = {"w": w, "b": torch.arange(6.0)}
    dense = Projection.from_rows("w", [2, 3, 4], "b")
    assert dense == Projection("w", 2, 5, "b") and dense.width == 3
    sparse = Projection.from_rows("w", [4, 0, 1], "b")
    assert (sparse.start, sparse.stop, sparse.width) == (0, 5, 3)
    assert torch.equal(sparse.weight_tensor(params), w[[4, 0, 1]])
    assert torch.equal(sparse.bias_tensor(params), torch.tensor([4.0, 0.0, 1.0]))
    t = Projection.from_rows("w", [1, 0], transposed=True)
    assert torch.equal(t.weight_tensor(params), w.t()[[1, 0]])


@pytest.mark.slow
def test_default_model():
    models = pytest.importorskip("lorc_fx.models")
    try:
        model = models.load_model("default")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"default model not available: {e}")
    blocks = analyze(model)
    assert len(blocks) == 30
    for i, b in enumerate(blocks):
        assert b.supported, b.reason
        assert (b.layer, b.num_heads, b.num_kv_heads, b.head_dim) == (i, 9, 3, 64)
        assert b.rope_q == b.rope_k == RopeLayout("half", 64)
        assert b.k == Projection(f"model.layers.{i}.self_attn.k_proj.weight", 0, 192)
        assert b.scale == pytest.approx(1 / math.sqrt(64))
    assert_projection_rows_exact(model, blocks)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_pairs_turned_the_other_way_are_the_layout_turned_by_minus_theta(style):
    """``(im, re)`` in place of each ``(re, im)`` (NanoChat's ``rotate_half``: ``cat(x2,
    -x1)``) is the same layout turning by -θ; pairs neither way round stay refused."""
    layout = RopeLayout(style, 8)
    assert classify_pairs(layout.pairs()) == layout
    assert classify_pairs(sorted((im, re) for re, im in layout.pairs())) == \
        RopeLayout(style, 8, turn=-1)
    mixed = [layout.pairs()[0][::-1], *layout.pairs()[1:]]
    assert isinstance(classify_pairs(sorted(mixed)), str)
