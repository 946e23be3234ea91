"""The compiled path over quantized caches (``latent_bits`` 8 or 4, dynamic cache).

The attention functions of ``compile.quantized_attention`` read the sides a
the dynamic layer's ``IntegerStore`` hands over (codes with spare slots, a window with spare rows)
and must equal attention over the same sides dequantized; the absorb pass must put them in
place of decode SDPA; and a compiled greedy ``generate`` must equal the eager one token for
token, without graph breaks, in a handful of graphs, with every decode attention reading
codes (no ``lorc::dequantize`` left to materialise the cache).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from torch import fx
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache

from lorc_fx.analysis import analyze
from lorc_fx.analysis.records import named_params
from lorc_fx.api import compress
from lorc_fx.cache import LatentCache, LatentCodec
from lorc_fx.cache.latent_ops import DEQUANTIZE, RECONSTRUCT, dequantize_codes_math
from lorc_fx.codes.integer import QuantSpec
from lorc_fx.cache.layers import LatentDynamicLayer
from lorc_fx.cache.stores.integer import IntegerStore
from lorc_fx.compile.backend import LorcBackend, lorc_backend
from lorc_fx.compile.latent_attention import (latent_attention, latent_scores, latent_sums,
                                              rotary_latent_attention)
from lorc_fx.compile import quantized_attention
from lorc_fx.compile.passes import absorb_latent_attention as absorb_module
from lorc_fx.compile.passes.absorb_latent_attention import absorb_latent_attention
from lorc_fx.compile.quantized_attention import (SUM_CHUNK, quantized_kv_attention,
                                                 quantized_latent_attention,
                                                 quantized_latent_scores, quantized_latent_sums,
                                                 quantized_rotary_latent_attention,
                                                 quantized_scores, quantized_sums)
from lorc_fx.kernels.code_reductions import native_applies
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import layer_inputs, plain_quantized_plan, value_token_group
from helpers.families import build, config_for
from helpers.pass_helpers import compiled, generate, prompt

D = 8  # head dim


# ---------------------------------------------------------------- sides as the layer hands them

def filled_layer(codec, k_spec, v_spec, batch, kv_heads, chunks, gen):
    """A quantized layer after updates of ``chunks`` tokens each (random keys and values)."""
    config = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=kv_heads,
                         head_dim=D, num_hidden_layers=1, vocab_size=16)
    cache = LatentCache.from_codecs(DynamicCache(config=config), {0: codec}, {0: (k_spec, v_spec)})
    for tokens in chunks:
        shape = (batch, kv_heads, tokens, D)
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 2, 0)
    return cache.layers[0]


def side(store, window, tokens):
    """The triple the absorb pass hands over for one side of the layer."""
    if store is None:
        return None, window, None
    q = store
    codes = (q.payload, q.scale, q.zero, q.spec.bits, q.spec.group,
             -2 if q.spec.axis % 4 == 2 else -1, q.shape[2], q.shape[3], q.dtype)
    return codes, window, tokens


def sides(layer: LatentDynamicLayer):
    tokens = layer.get_seq_length()
    return tuple(side(getattr(store, "codes", None), window, tokens)
                 for store, window in ((layer.k_store, layer.keys), (layer.v_store, layer.values)))


def attention_mask(kind: str, batch: int, t: int, n: int, gen):
    if kind == "none":
        return None
    if kind == "bool":
        mask = torch.rand(batch, 1, t, n, generator=gen) > 0.3
        mask[..., -1] = True  # no row masked out entirely
        mask[0, ..., :2] = False  # left padding
        return mask
    return torch.randn(batch, 1, t, n, generator=gen)


def orthonormal_rows(rank: int, width: int, gen) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(width, width, generator=gen)).Q.T[:rank].contiguous()


HEADS = st.sampled_from([(4, 2), (6, 1), (4, 4), (6, 3)])  # (query heads, kv heads)
SIDE_SETTINGS = settings(max_examples=60, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fillings(draw):
    """Bits, group and update sizes: a first chunk (a prompt), then single tokens, so the
    window ends anywhere in ``0 .. G - 1`` with whole groups quantized before it."""
    bits = draw(st.sampled_from([8, 4]))
    group = draw(st.sampled_from([2, 4, 8]))
    chunks = [draw(st.integers(1, 3 * group))] + [1] * draw(st.integers(0, 2 * group))
    return bits, group, chunks


@SIDE_SETTINGS
@given(filling=fillings(), heads=HEADS, batch=st.integers(1, 2), t=st.integers(1, 3),
       mask=st.sampled_from(["none", "bool", "float"]), seed=st.integers(0, 99))
def test_plain_quantized_attention_equals_sdpa_over_the_dequantized_cache(filling, heads, batch,
                                                                          t, mask, seed):
    """Keys per channel, values per token (a plain plan's layout); GQA: query head ``i`` reads
    kv head ``i // (h / h_kv)``."""
    (bits, group, chunks), (h, h_kv) = filling, heads
    gen = torch.Generator().manual_seed(seed)
    layer = filled_layer(LatentCodec(None, None, h_kv), QuantSpec.per_channel(bits, group),
                         QuantSpec.per_token(bits, value_token_group(D, group)), batch, h_kv,
                         chunks, gen)
    keys, values = layer.latents()
    q = torch.randn(batch, h, t, D, generator=gen)
    attn_mask = attention_mask(mask, batch, t, keys.shape[-2], gen)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=0.3,
                                              enable_gqa=True)
    got = quantized_kv_attention(q, *sides(layer), attn_mask=attn_mask, scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@SIDE_SETTINGS
@given(filling=fillings(), heads=HEADS, batch=st.integers(1, 2), t=st.integers(1, 3),
       mask=st.sampled_from(["none", "bool", "float"]), k_rank=st.integers(0, 6),
       v_rank=st.integers(1, 6), rotary=st.booleans(), seed=st.integers(0, 99))
def test_latent_quantized_attention_equals_latent_attention_over_the_dequantized_latents(
        filling, heads, batch, t, mask, k_rank, v_rank, rotary, seed):
    """Latents per channel, both sides quantized, or the keys zero-wide (kept in the model's
    dtype); post-RoPE keys absorbed, or pre-RoPE keys rebuilt and scored by angle."""
    (bits, group, chunks), (h, h_kv) = filling, heads
    gen = torch.Generator().manual_seed(seed)
    k_basis, v_basis = (orthonormal_rows(r, h_kv * D, gen) for r in (k_rank, v_rank))
    spec = QuantSpec.per_channel(bits, group)
    layer = filled_layer(LatentCodec(k_basis, v_basis, h_kv), spec if k_rank else None, spec,
                         batch, h_kv, chunks, gen)
    k_latent, v_latent = layer.latents()
    n = k_latent.shape[-2]
    q = torch.randn(batch, h, t, D, generator=gen)
    attn_mask = attention_mask(mask, batch, t, n, gen)
    if rotary:
        angles = torch.rand(batch, n, D // 2, generator=gen) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        expected = rotary_latent_attention(q, k_latent, cos, sin, v_latent, k_basis, v_basis,
                                           h_kv, "half", attn_mask=attn_mask, scale=0.3)
        k_side, v_side = sides(layer)
        got = quantized_rotary_latent_attention(q, k_side, cos, sin, v_side, k_basis, v_basis,
                                                h_kv, "half", attn_mask=attn_mask, scale=0.3)
    else:
        expected = latent_attention(q, k_latent, v_latent, k_basis, v_basis, h_kv,
                                    attn_mask=attn_mask, scale=0.3, use_kernel=False)
        got = quantized_latent_attention(q, *sides(layer), k_basis, v_basis, h_kv,
                                         attn_mask=attn_mask, scale=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def plain_or_latent_layer(rank: int, bits: int, group: int, chunks, batch: int, h_kv: int, gen):
    """A filled layer and its bases: a plain plan's (``rank`` 0: keys per channel, values per
    token, no bases) or latents of ``rank`` per channel through random orthonormal bases."""
    if not rank:
        return filled_layer(LatentCodec(None, None, h_kv), QuantSpec.per_channel(bits, group),
                            QuantSpec.per_token(bits, value_token_group(D, group)), batch,
                            h_kv, chunks, gen), None, None
    k_basis, v_basis = (orthonormal_rows(rank, h_kv * D, gen) for _ in range(2))
    spec = QuantSpec.per_channel(bits, group)
    return filled_layer(LatentCodec(k_basis, v_basis, h_kv), spec, spec, batch, h_kv, chunks,
                        gen), k_basis, v_basis


@SIDE_SETTINGS
@given(filling=fillings(), heads=HEADS, batch=st.integers(1, 2), t=st.integers(1, 3),
       rank=st.integers(0, 6), seed=st.integers(0, 99))
def test_manual_products_read_from_codes_equal_those_over_the_dequantized_cache(
        filling, heads, batch, t, rank, seed):
    """Manual attention's ``q @ kᵀ`` and ``p @ v`` read from the codes: a plain plan's keys
    per channel and values per token (``rank`` 0; query head ``i`` reading kv head ``i //
    (h / h_kv)``, as ``repeat_kv`` pairs them), or latents per channel through their bases."""
    (bits, group, chunks), (h, h_kv) = filling, heads
    gen = torch.Generator().manual_seed(seed)
    layer, k_basis, v_basis = plain_or_latent_layer(rank, bits, group, chunks, batch, h_kv, gen)
    keys, values = layer.latents()
    k_side, v_side = sides(layer)
    q = torch.randn(batch, h, t, D, generator=gen)
    probs = torch.randn(batch, h, t, keys.shape[-2], generator=gen).softmax(-1)
    if rank:
        expected = (latent_scores(q, keys, k_basis, h_kv),
                    latent_sums(probs, values, v_basis, h_kv))
        got = (quantized_latent_scores(q, k_side, k_basis, h_kv),
               quantized_latent_sums(probs, v_side, v_basis, h_kv))
    else:
        repeat = lambda x: x.repeat_interleave(h // h_kv, 1)  # noqa: E731
        expected = (q @ repeat(keys).transpose(-1, -2), probs @ repeat(values))
        got = quantized_scores(q, k_side), quantized_sums(probs, v_side)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@SIDE_SETTINGS
@given(filling=fillings(), heads=HEADS, batch=st.integers(1, 2), t=st.integers(1, 3),
       mask=st.sampled_from(["none", "bool", "float"]), rank=st.integers(0, 6),
       data=st.data(), seed=st.integers(0, 99))
def test_codes_read_in_a_token_order_equal_attention_over_them_gathered(
        filling, heads, batch, t, mask, rank, data, seed):
    """A static sliding layer's ring once its window is full hands every slot's codes and
    ``order``, the slot of each of the window's tokens (``(codes, None, None, order)``):
    SDPA (plain or absorbed) and manual attention's products over them equal those over the
    codes dequantized and gathered in that order; the slots it does not name weigh nothing."""
    (bits, group, chunks), (h, h_kv) = filling, heads
    gen = torch.Generator().manual_seed(seed)
    layer, k_basis, v_basis = plain_or_latent_layer(rank, bits, group, chunks, batch, h_kv, gen)
    codes = [side(store.codes, None, None)[0] for store in (layer.k_store, layer.v_store)]
    length = codes[0][6]
    assume(length > 0 and codes[1][6] == length)
    order = torch.randperm(length, generator=gen)[:data.draw(st.integers(1, length))]
    k_side, v_side = ((c, None, None, order) for c in codes)
    keys, values = (dequantize_codes_math(*c).index_select(2, order) for c in codes)
    q = torch.randn(batch, h, t, D, generator=gen)
    attn_mask = attention_mask(mask, batch, t, len(order), gen)
    probs = torch.randn(batch, h, t, len(order), generator=gen).softmax(-1)
    if rank:
        expected = (latent_attention(q, keys, values, k_basis, v_basis, h_kv,
                                     attn_mask=attn_mask, scale=0.3, use_kernel=False),
                    latent_scores(q, keys, k_basis, h_kv), latent_sums(probs, values, v_basis, h_kv))
        got = (quantized_latent_attention(q, k_side, v_side, k_basis, v_basis, h_kv,
                                          attn_mask=attn_mask, scale=0.3),
               quantized_latent_scores(q, k_side, k_basis, h_kv),
               quantized_latent_sums(probs, v_side, v_basis, h_kv))
    else:
        repeat = lambda x: x.repeat_interleave(h // h_kv, 1)  # noqa: E731
        expected = (F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                                   scale=0.3, enable_gqa=True),
                    q @ repeat(keys).transpose(-1, -2), probs @ repeat(values))
        got = (quantized_kv_attention(q, k_side, v_side, attn_mask=attn_mask, scale=0.3),
               quantized_scores(q, k_side), quantized_sums(probs, v_side))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def run_and_get_kernels(fn, *inputs):
    """``fn`` traced to aten ops and compiled by Inductor (as ``lorc_backend`` compiles the
    rewritten graph); its output and generated code."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import run_and_get_code
    from torch.fx.experimental.proxy_tensor import make_fx

    out, code = run_and_get_code(lambda: compile_fx(make_fx(fn)(*inputs), list(inputs))(*inputs))
    return out, "\n".join(code)


@pytest.mark.parametrize("tokens", [SUM_CHUNK + 1, 3 * SUM_CHUNK - 5])
def test_long_contexts_sum_in_chunks_to_the_same_attention(tokens):
    """Past ``SUM_CHUNK`` positions the softmax and the per-token value sums add up chunk
    by chunk (``_sum``); a query row with every key masked still gets zeros."""
    gen = torch.Generator().manual_seed(tokens)
    layer = filled_layer(LatentCodec(None, None, 2), QuantSpec.per_channel(8, 8),
                         QuantSpec.per_token(8, value_token_group(D, 8)), 2, 2, [tokens, 1, 1],
                         gen)
    keys, values = layer.latents()
    q = torch.randn(2, 4, 3, D, generator=gen)
    attn_mask = attention_mask("bool", 2, 3, keys.shape[-2], gen)
    attn_mask[1, :, 2] = False
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                              enable_gqa=True)
    expected[1, :, 2] = 0.0
    got = quantized_kv_attention(q, *sides(layer), attn_mask=attn_mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def float_buffers(code: str) -> list[int]:
    """Elements of every float32 buffer the generated code allocates."""
    sizes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.float32\)", code)
    return [eval("*".join(s.strip(", ").split(", ")) or "1") for s in sizes]


@pytest.mark.inductor
@pytest.mark.parametrize("kind", ["plain", "latent"])
def test_inductor_reads_codes_without_a_full_precision_copy(kind):
    """Compiled by Inductor, the attention equals the reference and allocates no float buffer
    as large as a dequantized side: the dequantization is fused into the reductions."""
    gen = torch.Generator().manual_seed(0)
    h, h_kv, group = 6, 2, 16
    chunks = [5 * group + 3, 1, 1]
    if kind == "plain":
        layer = filled_layer(LatentCodec(None, None, h_kv), QuantSpec.per_channel(4, group),
                             QuantSpec.per_token(4, group), 1, h_kv, chunks, gen)
        keys, values = layer.latents()
        q = torch.randn(1, h, 1, D, generator=gen)
        expected = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        attend = quantized_kv_attention
        extra = ()
    else:
        k_basis, v_basis = (orthonormal_rows(h_kv * D, h_kv * D, gen) for _ in range(2))
        spec = QuantSpec.per_channel(4, group)
        layer = filled_layer(LatentCodec(k_basis, v_basis, h_kv), spec, spec, 1, h_kv, chunks,
                             gen)
        keys, values = layer.latents()
        q = torch.randn(1, h, 1, D, generator=gen)
        expected = latent_attention(q, keys, values, k_basis, v_basis, h_kv, use_kernel=False)
        attend = quantized_latent_attention
        extra = (k_basis, v_basis, h_kv)
    (k_codes, k_window, tokens), (v_codes, v_window, _) = sides(layer)

    def fn(q, kp, ks, kz, kw, vp, vs, vz, vw):
        return attend(q, ((kp, ks, kz, *k_codes[3:]), kw, tokens),
                      ((vp, vs, vz, *v_codes[3:]), vw, tokens), *extra)

    got, code = run_and_get_kernels(fn, q, *k_codes[:3], k_window, *v_codes[:3], v_window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    dequantized_side = min(keys.numel(), values.numel())
    assert max(float_buffers(code)) < dequantized_side


# ---------------------------------------------------------------- the absorb pass

def decode_graph(kind: str, window: str):
    """``sdpa(q, K, V)`` over sides as the quantized layer traces them: ``K``/``V`` are
    ``cat([lorc.dequantize(codes), window]).narrow(2, 0, tokens)`` (``window="spare"``),
    ``cat([...])`` (``"cat"``) or a bare ``lorc.dequantize`` (``"none"``), through
    ``lorc.reconstruct`` for a latent plan (``kind="latent"``)."""
    g = fx.Graph()
    names = ("q", "kp", "ks", "kz", "kw", "vp", "vs", "vz", "vw", "pk", "pv")
    q, kp, ks, kz, kw, vp, vs, vz, vw, pk, pv = (g.placeholder(n) for n in names)

    def read(payload, scale, zero, rest, win):
        x = g.call_function(DEQUANTIZE, (payload, scale, zero, *rest))
        if window != "none":
            x = g.call_function(torch.cat, ([x, win],), dict(dim=-2))
        if window == "spare":
            x = g.call_method("narrow", (x, 2, 0, TOKENS))
        return x

    k = read(kp, ks, kz, K_REST[kind], kw)
    v = read(vp, vs, vz, V_REST[kind], vw)
    if kind == "latent":
        k, v = (g.call_function(RECONSTRUCT, (x, basis, 2)) for x, basis in ((k, pk), (v, pv)))
    g.output(g.call_function(F.scaled_dot_product_attention, (q, k, v), dict(enable_gqa=True)))
    return fx.GraphModule(torch.nn.Module(), g)


GROUP, TOKENS = 4, 15  # 12 quantized tokens (3 groups, + 2 spare), a window of 3 (+ 2 spare)
K_REST = {"plain": (4, GROUP, -2, 12, D, torch.float32),
          "latent": (4, GROUP, -2, 12, 6, torch.float32)}
V_REST = {"plain": (4, GROUP, -1, 12, D, torch.float32),
          "latent": (4, GROUP, -2, 12, 6, torch.float32)}


def decode_inputs(kind: str, window: str, t: int = 1):
    from lorc_fx.codes.integer import quantize

    gen = torch.Generator().manual_seed(0)
    width = D if kind == "plain" else 6
    heads = 2 if kind == "plain" else 1
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    k = quantize(rand(1, heads, 12 + 2 * GROUP, width), QuantSpec.per_channel(4, GROUP))
    v_spec = QuantSpec.per_token(4, GROUP) if kind == "plain" else QuantSpec.per_channel(4, GROUP)
    v = quantize(rand(1, heads, 12 + 2 * GROUP, width), v_spec)
    rows = {"spare": 5, "cat": 3, "none": 0}[window]
    basis = lambda: torch.linalg.qr(rand(2 * D, 6)).Q.T.contiguous()  # noqa: E731
    return [rand(1, 4, t, D), k.payload, k.scale, k.zero, rand(1, heads, rows, width),
            v.payload, v.scale, v.zero, rand(1, heads, rows, width), basis(), basis()]


def with_examples(gm: fx.GraphModule, inputs) -> None:
    """Every node's value in ``meta["example_value"]``, as dynamo records it."""
    class Recorder(fx.Interpreter):
        def run_node(self, node):
            node.meta["example_value"] = out = super().run_node(node)
            return out

    Recorder(gm).run(*inputs)


@pytest.mark.parametrize("kind, function", [("plain", quantized_kv_attention),
                                            ("latent", quantized_latent_attention)])
@pytest.mark.parametrize("window", ["spare", "cat", "none"])
def test_absorb_reads_quantized_sides_in_decode_graphs(kind, function, window):
    gm = decode_graph(kind, window)
    inputs = decode_inputs(kind, window)
    with_examples(gm, inputs)
    expected = gm(*inputs)
    assert absorb_latent_attention(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert function in targets and DEQUANTIZE not in targets and torch.cat not in targets
    torch.testing.assert_close(gm(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_absorb_leaves_quantized_prefill_to_the_lowering(monkeypatch):
    """More query tokens than ``MAX_DECODE_QUERY``: plain SDPA stays, over the dequantized
    side (the latent plan's becomes ``latent_attention`` over it)."""
    monkeypatch.setattr(absorb_module, "MAX_DECODE_QUERY", 2)
    for kind in ("plain", "latent"):
        gm = decode_graph(kind, "spare")
        inputs = decode_inputs(kind, "spare", t=3)
        with_examples(gm, inputs)
        absorbed = absorb_latent_attention(gm)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert DEQUANTIZE in targets
        assert absorbed == (kind == "latent")


# ---------------------------------------------------------------- compiled generate

def compress_quantized(model, mode: str, bits: int, group: int):
    if mode == "plain":
        blocks = analyze(model)
        plan = plain_quantized_plan(layer_inputs(named_params(model), blocks),
                                    PlanOptions(latent_bits=bits, latent_group=group))
        compress(model, plan=plan, blocks=blocks)
    else:
        compress(model, 0.6, basis="weight", schedule="uniform", rope=mode, latent_bits=bits,
                 latent_group=group)


def compiled_generate(model, backend, ids, mask, new_tokens, **kwargs):
    """Greedy ``generate`` through ``backend``; the graphs it compiled, graph breaks counted."""
    from torch._dynamo.utils import counters

    graphs = []

    def spy(gm, example_inputs):
        compiled_fn = backend(gm, example_inputs)
        graphs.append(gm)
        return compiled_fn

    counters.clear()
    with compiled(model, spy):
        out = generate(model, ids, mask, new_tokens=new_tokens, **kwargs)
    return out, graphs, sum(counters["graph_break"].values())


def assert_decode_reads_codes(backend, graphs, rewrites: int):
    """Every attention (SDPA, or manual attention's two products) of every decode graph
    rewritten, ``rewrites`` a graph, and no dequantization left in them (the first graph is
    the prefill)."""
    assert [r.absorbed for r in backend.reports[1:]] == [rewrites] * (len(graphs) - 1)
    for gm in graphs[1:]:
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert not targets & {DEQUANTIZE, dequantize_codes_math}


@pytest.mark.parametrize("family, mode, bits", [
    ("llama", "commute", 8), ("llama", "reconstruct", 4), ("llama", "plain", 4),
    ("gemma2", "commute", 4), ("gpt_oss", "plain", 8), ("bloom", "plain", 4),
    pytest.param("llama", "commute", 4, marks=pytest.mark.slow),
    pytest.param("llama", "reconstruct", 8, marks=pytest.mark.slow),
    pytest.param("llama", "plain", 8, marks=pytest.mark.slow)])
def test_compiled_generate_over_quantized_latents_matches_eager(family, mode, bits, monkeypatch):
    """Groups of 8, a prompt of 6 (shorter than a group) and 64 new tokens: 8 groups settle.
    Prefill (more tokens than the patched ``MAX_DECODE_QUERY``) reads the cache dequantized.
    Gemma 2 (softcap), gpt-oss (sinks) and BLOOM (heads merged into the batch, ALiBi) run
    manual attention: each of its two products reads the codes.

    Graphs: 3 — prefill, the decode steps while no group is stored (a prompt shorter than a
    group: a count of 0 coded tokens, which dynamo specialises), then one graph for every later
    step. ``generate`` marks the windows' and codes' lengths dynamic before each step
    (``LatentCache.mark_dynamic``; never 0 or 1: spare rows and slots), and a group settles
    inside the graph, so no length or settling compiles another."""
    monkeypatch.setattr(absorb_module, "MAX_DECODE_QUERY", 2)
    model = build(config_for(family, heads=4, kv_heads=2, layers=2))
    ids, mask = prompt(length=6)
    compress_quantized(model, mode, bits, group=8)
    expected = generate(model, ids, mask, new_tokens=64)
    backend = lorc_backend.with_options(inductor=False)
    got, graphs, breaks = compiled_generate(model, backend, ids, mask, 64)
    assert isinstance(got.past_key_values.layers[0].k_store, IntegerStore)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               atol=1e-4, rtol=1e-4)
    assert breaks == 0
    assert len(graphs) == 3
    products = 1 if family == "llama" else 2
    assert_decode_reads_codes(backend, graphs, products * model.config.num_hidden_layers)


@pytest.mark.parametrize("bits, cache", [(8, "dynamic"), (4, "static")])
def test_plain_decode_over_heads_of_64_runs_the_fused_kernel(bits, cache, monkeypatch):
    """Heads of 64 dims, codes in groups of 32: on a CPU the C++ kernel serves
    (``lorc::code_attention``, lorc_fx/kernels/code_reductions.py), every decode attention
    takes it, in a dynamic cache (a window after the codes) and a static one (a spare key
    group past the values), and generate gives the eager tokens."""
    if not native_applies(torch.device("cpu"), bits, 32):
        pytest.skip("the C++ kernel does not build on this machine")
    taken = []
    fused_applies = quantized_attention._fused_applies
    monkeypatch.setattr(quantized_attention, "_fused_applies",
                        lambda *args: taken.append(fused_applies(*args)) or taken[-1])
    model = build(config_for("llama", heads=4, kv_heads=2, head_dim=64, layers=2))
    ids, mask = prompt(length=6)
    compress_quantized(model, "plain", bits, group=32)
    kwargs = {} if cache == "dynamic" else {"cache": "static"}
    expected = generate(model, ids, mask, new_tokens=40, **kwargs)
    got, graphs, breaks = compiled_generate(model, lorc_backend.with_options(inductor=False),
                                            ids, mask, 40, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               atol=1e-4, rtol=1e-4)
    assert breaks == 0 and taken and all(taken)


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("mode, bits", [pytest.param("plain", 4, marks=pytest.mark.vectorized),
                                        ("reconstruct", 4)])
def test_inductor_generate_over_quantized_latents_matches_eager(mode, bits):
    """Through Inductor (~20 s a graph on 2 cores: slow). Measured: 4 or 5 graphs, tokens
    equal. 8-bit latents of an absorbed (commute) plan through Inductor: the static cache's
    test (tests/cache/test_quantized_static.py::test_inductor_decode_matches_eager). The
    ``plain`` case compiles vectorized kernels (tests/conftest.py), so that Inductor's SIMD
    unpacking of 4-bit codes is checked on a toy as well as the real model's 8-bit ones."""
    model = build(config_for("llama", heads=4, kv_heads=2, layers=1))
    ids, mask = prompt(length=6)
    compress_quantized(model, mode, bits, group=4)
    expected = generate(model, ids, mask, new_tokens=24)
    backend = lorc_backend.with_options()
    got, graphs, breaks = compiled_generate(model, backend, ids, mask, 24)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               atol=1e-4, rtol=1e-4)
    assert breaks == 0 and len(graphs) <= 5
    assert_decode_reads_codes(backend, graphs, model.config.num_hidden_layers)


# ---------------------------------------------------------------- the backend's options

def test_backend_takes_latent_bits_but_refuses_to_quantize_an_uncompressed_model():
    """Compressing cache-free attention from the graph's weights caches nothing to quantize."""
    backend = LorcBackend(inductor=False, latent_bits=4)
    assert backend.passes.uuid() != LorcBackend(inductor=False).passes.uuid()
    model = build(config_for("llama", layers=1))
    ids, _ = prompt(batch=1)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="latent_bits=4"):
        torch.compile(model, backend=backend)(ids, use_cache=False)
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["per_channel", "per_token"])
def test_the_lowered_dequantize_is_contiguous_so_prefill_keeps_the_fused_sdpa(layout):
    """SDPA's fused CPU kernel needs a last dim of stride 1; a per-channel side's codes
    unpack with the channel axis strided, and a compiled prefill over it fell back to unfused
    maths (2.3× slower at 4096 tokens)."""
    from lorc_fx.codes.integer import dequantize, quantize

    x = torch.randn(1, 3, 100, 64)
    q = quantize(x, getattr(QuantSpec, layout)(8, 32, torch.float16))
    out = dequantize_codes_math(q.payload, q.scale, q.zero, 8, 32, -2 if layout == "per_channel"
                                else -1, 100, 64, torch.float32)
    assert out.is_contiguous()
    torch.testing.assert_close(out, dequantize(q), atol=0, rtol=0)
