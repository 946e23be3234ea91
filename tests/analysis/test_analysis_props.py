"""Property tests: the analysis recovers drawn attention configurations.

Each example costs a dynamo capture (~1 s), so examples are few.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.analysis_toys import ToyGPT
from lorc_fx.analysis import analyze
from lorc_fx.analysis.records import RopeLayout
from test_analysis import assert_projection_rows_exact, hf_model

SETTINGS = settings(max_examples=12, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def hf_configs(draw):
    """Llama / Qwen2 (GQA, bias, full RoPE) or GPT-NeoX (MHA, partial rotary)."""
    family = draw(st.sampled_from(["LlamaConfig", "Qwen2Config", "GPTNeoXConfig"]))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8, 12]))
    layers = draw(st.integers(1, 3))
    common = dict(num_hidden_layers=layers, num_attention_heads=heads, vocab_size=64,
                  intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    if family == "GPTNeoXConfig":
        rotary = draw(st.sampled_from([r for r in (2, 4, 8, 12) if r <= head_dim]))
        kw = dict(common, hidden_size=heads * head_dim, rotary_pct=rotary / head_dim)
        return family, kw, (heads, heads, head_dim, RopeLayout("half", rotary), layers, True)
    bias = family == "Qwen2Config" or draw(st.booleans())
    kw = dict(common, hidden_size=heads * draw(st.sampled_from([4, 8])), head_dim=head_dim,
              num_key_value_heads=kv_heads)
    if family == "LlamaConfig":
        kw["attention_bias"] = bias
    return family, kw, (heads, kv_heads, head_dim, RopeLayout("half", head_dim), layers, bias)


@SETTINGS
@given(hf_configs())
def test_transformers_configs_are_recovered(drawn):
    family, kw, (heads, kv_heads, head_dim, rope, layers, bias) = drawn
    model = hf_model(family, **kw)
    blocks = analyze(model)
    assert len(blocks) == layers
    for b in blocks:
        assert b.supported, b.reason
        assert (b.num_heads, b.num_kv_heads, b.head_dim) == (heads, kv_heads, head_dim)
        assert b.rope_q == b.rope_k == rope
        assert (b.k.bias is not None) == bias
    assert_projection_rows_exact(model, blocks)


@st.composite
def toy_configs(draw):
    kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 6, 8]))
    rope = draw(st.sampled_from(["none", "half", "interleaved", "complex"]))
    rotary = draw(st.sampled_from(range(2, head_dim + 1, 2))) if rope != "none" else None
    return dict(dim=draw(st.sampled_from([16, 24])), layers=draw(st.integers(1, 2)),
                heads=kv_heads * draw(st.integers(1, 3)), kv_heads=kv_heads, head_dim=head_dim,
                rope=rope, rotary_dim=rotary, fused=draw(st.booleans()),
                bias=draw(st.booleans()))


@SETTINGS
@given(toy_configs())
def test_hand_written_configs_are_recovered(kw):
    torch.manual_seed(0)
    blocks = analyze(ToyGPT(**kw))
    rope = RopeLayout() if kw["rope"] == "none" else RopeLayout(
        "half" if kw["rope"] == "half" else "interleaved", kw["rotary_dim"])
    assert len(blocks) == kw["layers"]
    for b in blocks:
        assert b.supported, b.reason
        assert (b.num_heads, b.num_kv_heads, b.head_dim) == (
            kw["heads"], kw["kv_heads"], kw["head_dim"])
        assert b.rope_q == b.rope_k
        # with a single pair (rotary_dim 2) both styles pair the same dims
        assert (b.rope_k.rotary_dim, b.rope_k.pairs()) == (rope.rotary_dim, rope.pairs())
        assert b.q.width == kw["heads"] * kw["head_dim"]
        assert b.k.width == b.v.width == kw["kv_heads"] * kw["head_dim"]
        assert b.scale == pytest.approx(kw["head_dim"] ** -0.5)
