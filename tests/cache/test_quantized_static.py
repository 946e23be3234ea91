"""Quantized latents in a static cache (``LatentStaticLayer`` with ``IntegerStaticStore``
sides): preallocated codes
written in place at tensor positions, the current group re-quantized from its
full-precision window at every write.

The layer is checked against the exact latents (every cached token within half a step of
its group's range) and against the dynamic layer's ``IntegerStore`` fed the same tokens (whole
groups equal bit for bit; the dynamic layer holds the partial group in full precision, so
there the two differ by up to half a step). Through a model: ``generate`` with
``cache_implementation="static"`` in both RoPE modes and for plain quantization, logits
within the dynamic tests' bounds (test_quantized_latents.py), nothing changed at 16 bits,
and compiled decode steps that trace once with no graph break.
"""
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch._dynamo.utils import counters
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, StaticCache

from lorc_fx.api import compress
from lorc_fx.cache import LatentCache, LatentCodec, latent_cache
from lorc_fx.cache.latent_ops import DEQUANTIZE, RECONSTRUCT, ROTATED_RECONSTRUCT
from lorc_fx.cache.install import STATIC_LENGTH_STEP
from lorc_fx.cache.layers import PREFILL_TOKENS, LatentStaticLayer
from lorc_fx.codes.integer import QuantizedTensor, QuantSpec, quantize
from lorc_fx.cache.stores.integer_static import IntegerStaticStore
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.options import PlanOptions
from helpers.families import VOCAB, build, config_for
from helpers.pass_helpers import generate, prompt

KV_HEADS, HEAD_DIM = 2, 8
WIDTH = KV_HEADS * HEAD_DIM
CONFIG = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=16)
EPS = torch.finfo(torch.float32).eps


def orthonormal_rows(rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=gen))
    return q.T[:rank].contiguous()


def per_element(codes, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and zero point each of the first ``n`` tokens was quantized with,
    ``(b, h, n, d)``."""
    spec, d = codes.spec, codes.shape[3]
    if spec.axis == -2:  # (b, h, d, slots): slot j holds tokens [jG, (j+1)G)
        spread = lambda t: t.repeat_interleave(spec.group, -1)[..., :n].transpose(-1, -2)
    else:  # (b, h, max, groups of channels)
        spread = lambda t: t.repeat_interleave(spec.group, -1)[..., :n, :d]
    return spread(codes.scale.float()), spread(codes.zero.float())


def assert_within_half_a_step(got: torch.Tensor, exact: torch.Tensor, codes, n: int) -> None:
    """Tokens within half their group's step (plus float32 rounding of ``zero + code·scale``
    and the rounding of the result to the latents' dtype)."""
    if codes is None:
        assert torch.equal(got[..., :n, :], exact)
        return
    step, zero = per_element(codes, n)
    exact = exact.float()
    slack = (4 * EPS * (zero.abs() + step * (2 ** codes.spec.bits - 1))
             + torch.finfo(got.dtype).eps * (exact.abs() + step))
    err = (got[..., :n, :].float() - exact).abs()
    assert bool((err <= step / 2 + slack).all()), float((err - step / 2).max())


def assert_whole_groups_match(static_codes, dynamic_quant, n: int) -> None:
    """What the dynamic layer has quantized, the static layer holds bit for bit: per channel
    the whole groups, per token every token the dynamic layer moved out of its window."""
    if static_codes is None or dynamic_quant is None:
        return
    if static_codes.spec.axis == -2:
        groups = n // static_codes.spec.group
        assert dynamic_quant.payload.shape[-2] == groups
        take = lambda t, d: t.narrow(d, 0, groups)
        dims = (3, 3)
    else:
        take = lambda t, d: t.narrow(d, 0, dynamic_quant.shape[2])
        dims = (2, 2)
    assert torch.equal(take(static_codes.payload, dims[0]), dynamic_quant.payload)
    assert torch.equal(take(static_codes.scale, dims[1]), dynamic_quant.scale)
    assert torch.equal(take(static_codes.zero, dims[1]), dynamic_quant.zero)


def overhead_bytes(batch: int, specs, widths, dtype_bytes: int) -> int:
    """Bytes beyond the plan's per-token rate that a static quantized layer holds for
    ``max_cache_len`` a whole number of groups: per per-channel side of width ``w`` and batch
    row, the window (``G·w`` floats) and the spare group slot (``w`` groups of codes and a
    16-bit scale and zero point)."""
    return batch * sum(w * (spec.group * dtype_bytes + spec.group * spec.bits // 8 + 2 * 2)
                       for spec, w in zip(specs, widths) if spec is not None and spec.axis == -2)


# ---------------------------------------------------------------- the layer

STEPS = st.one_of(st.integers(1, 20), st.sampled_from(["reorder", "reset"]))


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 4, 6, 8, 16]),
       k_rank=st.integers(0, WIDTH), v_rank=st.integers(1, WIDTH),
       v_per_token=st.booleans(), batch=st.integers(1, 3), prefill=st.integers(1, 40),
       steps=st.lists(STEPS, max_size=8), slack=st.integers(0, 17), seed=st.integers(0, 99),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_layer_within_half_a_step_and_whole_groups_as_the_dynamic_layers(
        bits, group, k_rank, v_rank, v_per_token, batch, prefill, steps, slack, seed, dtype):
    """Any sequence of writes (a prefill of any length, then decode steps, drafts, beam
    reorders, resets) within ``max_cache_len``; latents, scales and zero points in
    ``dtype`` (16-bit ones rounded outward, as ``quantize`` rounds them)."""
    k_spec = QuantSpec.per_channel(bits, group) if k_rank else None
    v_spec = (QuantSpec.per_token if v_per_token else QuantSpec.per_channel)(bits, group)
    codec = LatentCodec(orthonormal_rows(k_rank, seed), orthonormal_rows(v_rank, seed + 1),
                        KV_HEADS)
    max_len = prefill + sum(s for s in steps if isinstance(s, int)) + slack
    static = LatentCache.from_codecs(StaticCache(config=CONFIG, max_cache_len=max_len),
                                     {0: codec}, {0: (k_spec, v_spec)})
    dynamic = LatentCache.from_codecs(DynamicCache(config=CONFIG), {0: codec},
                                      {0: (k_spec, v_spec)})
    layer, reference = static.layers[0], dynamic.layers[0]
    assert isinstance(layer, LatentStaticLayer) and isinstance(layer.v_store, IntegerStaticStore)
    gen = torch.Generator().manual_seed(seed)
    exact_k = exact_v = None
    for i, step in enumerate([prefill, *steps]):
        if step == "reorder":
            order = torch.randperm(batch, generator=gen)
            static.reorder_cache(order)
            dynamic.reorder_cache(order)
            if exact_k is None:
                continue
            exact_k, exact_v = exact_k[order], exact_v[order]
        elif step == "reset":
            static.reset()
            dynamic = LatentCache.from_codecs(DynamicCache(config=CONFIG), {0: codec},
                                              {0: (k_spec, v_spec)})
            reference = dynamic.layers[0]
            exact_k = exact_v = None
            assert int(static.get_seq_length()) == 0
            continue
        else:
            shape = (batch, KV_HEADS, step, HEAD_DIM)
            keys = (torch.randn(shape, generator=gen) * (i + 1)).to(dtype)  # ranges vary
            values = (torch.randn(shape, generator=gen) * 3).to(dtype)
            got_k, got_v = static.update(keys, values, 0)
            dynamic.update(keys, values, 0)
            k, v = layer.bases.compress(keys, values)  # the codec in the latents' dtype
            before = 0 if exact_k is None else exact_k.shape[-2]
            exact_k = k if exact_k is None else torch.cat([exact_k, k], dim=-2)
            exact_v = v if exact_v is None else torch.cat([exact_v, v], dim=-2)
            assert got_k.shape[-2] == max_len  # attention reads the whole allocation
            want_k, want_v = layer.bases.expand(*layer.latents())
            if step > PREFILL_TOKENS:  # a prefill attends its own tokens as they came
                want_k[..., before:before + step, :] = keys
                want_v[..., before:before + step, :] = values
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        n = exact_k.shape[-2]
        assert int(static.get_seq_length()) == n == dynamic.get_seq_length()
        lk, lv = layer.latents()
        assert bool(torch.isfinite(lk).all() and torch.isfinite(lv).all())  # masked, never NaN
        k_codes, v_codes = (getattr(s, "codes", None) for s in (layer.k_store, layer.v_store))
        assert_within_half_a_step(lk, exact_k, k_codes, n)
        assert_within_half_a_step(lv, exact_v, v_codes, n)
        assert_whole_groups_match(k_codes, getattr(reference.k_store, "quantized", None), n)
        assert_whole_groups_match(v_codes, reference.v_store.quantized, n)
        if v_per_token:  # a token's codes are final as written
            q = quantize(exact_v, v_spec)
            assert torch.equal(v_codes.payload[:, :, :n], q.payload)
            assert torch.equal(v_codes.scale[:, :, :n], q.scale)
    # bytes: the whole allocation, measured
    slots, size = -(-max_len // group) + 1, dtype.itemsize
    expected = 0
    for spec, rank in ((k_spec, k_rank), (v_spec, v_rank)):
        if spec is None:
            expected += rank * max_len * size
        elif spec.axis == -2:  # codes, scales and zero points of every slot, and the window
            expected += rank * (slots * (group * bits // 8 + 2 * size) + group * size)
        else:  # per token: channels padded to whole groups
            groups = -(-rank // group)
            expected += max_len * groups * (group * bits // 8 + 2 * size)
    assert static.cache_bytes() == batch * expected


def test_a_write_past_max_cache_len_fails_loudly():
    spec = QuantSpec.per_channel(4, 4)
    codec = LatentCodec(orthonormal_rows(6, 0), orthonormal_rows(6, 1), KV_HEADS)
    cache = LatentCache.from_codecs(StaticCache(config=CONFIG, max_cache_len=8), {0: codec},
                                    {0: (spec, spec)})
    states = torch.randn(1, KV_HEADS, 8, HEAD_DIM)
    cache.update(states, states, 0)  # fills it, the window moves to the spare slot
    with pytest.raises((IndexError, RuntimeError)):
        cache.update(states[..., :4, :], states[..., :4, :], 0)


@pytest.mark.inductor
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_scales_compile_to_the_eager_codes(dtype):
    """Inductor elides a float round trip through a 16-bit dtype and steps ``nextafter`` in
    float32; the layer's rounding survives both, so compiled codes are eager's, bit for bit."""
    from lorc_fx.cache.stores.integer_static import _write_groups

    spec = QuantSpec.per_channel(8, 32)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 64, 32, generator=gen) * torch.rand(16, 64, 1, generator=gen)
         + 100 * torch.randn(16, 64, 1, generator=gen)).to(dtype)  # ranges small to |zero|

    def quantized(t):
        codes = QuantizedTensor(t.new_zeros(16, 64, 32, dtype=torch.uint8), t.new_zeros(16, 64),
                                t.new_zeros(16, 64), spec, (16, 32, 64), dtype)
        _write_groups(codes, t, None, 1, torch.arange(64))
        return codes.payload, codes.scale, codes.zero

    eager = quantized(x)
    torch._dynamo.reset()
    compiled = torch.compile(quantized)(x)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    reference = quantize(x.transpose(-1, -2), spec)  # the dynamic layer's: one group a row
    for got, want in zip(eager, (reference.payload, reference.scale, reference.zero)):
        assert torch.equal(got, want.reshape(got.shape))


# ---------------------------------------------------------------- through a model

@pytest.fixture(scope="module")
def model():
    return build(config_for("llama"))


def analysed(model):
    """The model's attention blocks and the planner's inputs for them."""
    from lorc_fx.analysis import analyze
    from lorc_fx.analysis.records import named_params
    from lorc_fx.plan.planner import layer_inputs

    blocks = analyze(model)
    return blocks, layer_inputs(named_params(model), blocks)


@pytest.fixture(scope="module")
def inputs(model):
    return analysed(model)


def plain_plan(inputs, bits: int, group: int):
    from lorc_fx.plan.planner import plain_quantized_plan

    return plain_quantized_plan(inputs[1], PlanOptions(latent_bits=bits, latent_group=group))


def install(model, inputs, kind: str, bits: int, group: int = 8):
    """``kind``: a RoPE mode of the full-rank low-rank plan, or ``"plain"`` quantization
    (``inputs``: ``analysed(model)``)."""
    if kind == "plain":
        return compress(model, plan=plain_plan(inputs, bits, group), blocks=inputs[0])
    return compress(model, 1.0, schedule="uniform", basis="weight", rope=kind,
                    latent_bits=bits, latent_group=group)


@pytest.mark.parametrize("kind", ["commute", "reconstruct", "plain"])
def test_static_generate_with_padding_and_beams(model, inputs, kind):
    """The bounds of test_quantized_latents.py against the unquantized static cache (1% of
    the largest logit at 8 bits, 25% at 4); at 8 bits the same tokens."""
    ids, mask = prompt(length=20, seed=1)
    compress(model, 1.0, schedule="uniform", basis="weight",
             rope="commute" if kind == "plain" else kind)
    reference = generate(model, ids, mask, "static", new_tokens=10)
    for bits, bound in ((8, 0.01), (4, 0.25)):
        install(model, inputs, kind, bits)
        got = generate(model, ids, mask, "static", new_tokens=10)
        beams = generate(model, ids, mask, "static", new_tokens=4, num_beams=2)
        cache = got.past_key_values
        assert all(isinstance(l.k_store, IntegerStaticStore) for l in cache.layers)
        assert (cache.rotary is not None) == (kind == "reconstruct")
        assert got.sequences.shape == reference.sequences.shape
        for step, (g, w) in enumerate(zip(got.logits, reference.logits)):
            if bits == 4 and step:  # 4-bit tokens may differ: later steps see other inputs
                break
            assert (g - w).abs().max() / w.abs().max() < bound
        if bits == 8:
            assert torch.equal(got.sequences, reference.sequences)
        assert beams.sequences.shape == (2, 24)


def test_16_bits_changes_nothing(model):
    ids, mask = prompt(length=12)
    compress(model, 1.0, schedule="uniform", basis="weight", rope="reconstruct")
    default = generate(model, ids, mask, "static", new_tokens=6)
    compress(model, 1.0, schedule="uniform", basis="weight", rope="reconstruct", latent_bits=16,
             latent_group=8)
    explicit = generate(model, ids, mask, "static", new_tokens=6)
    assert torch.equal(torch.stack(default.logits), torch.stack(explicit.logits))
    assert all(type(l) is LatentStaticLayer for l in explicit.past_key_values.layers)
    assert default.past_key_values.cache_bytes() == explicit.past_key_values.cache_bytes()


@pytest.mark.parametrize("kind", ["commute", "reconstruct", "plain"])
@settings(max_examples=6, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 4, 8, 16]),
       budget=st.floats(3.0, 14.0), keep_first=st.integers(0, 1), groups=st.integers(1, 3),
       batch=st.integers(1, 2), length=st.integers(1, 48))
def test_measured_bytes_are_the_plans_plus_windows_and_spare_slots(
        model, inputs, kind, bits, group, budget, keep_first, groups, batch, length):
    """``max_cache_len`` a whole number of groups: the plan's bytes (and bits, floats at 16)
    for every allocated token, plus each per-channel side's window and spare slot; the
    values stood for are the whole allocation's. Mixed plans: quantized latents beside the
    RoPE angle log and a layer kept full."""
    from lorc_fx.plan.planner import plan_layers
    from lorc_fx.plan.schedules import UnreachableFraction

    blocks, layer_inputs = inputs
    if kind == "plain":
        plan = plain_plan(inputs, bits, group)
    else:
        options = PlanOptions(bits_per_value=budget, latent_bits=bits, latent_group=group,
                              schedule="uniform", basis="weight", rope=kind,
                              keep_first=keep_first, rank_multiple=1)
        try:
            plan = plan_layers(layer_inputs, options)
        except UnreachableFraction:
            assume(False)
    compress(model, plan=plan, blocks=blocks)
    max_len = groups * group
    cache = latent_cache(model, max_len)
    positions = torch.arange(min(length, max_len)).expand(batch, -1)
    ids = torch.randint(3, VOCAB, positions.shape, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        model(ids, position_ids=positions, past_key_values=cache, use_cache=True)
    extra = extra_bits = 0
    for l in plan.layers:
        sides = [l.k_code, l.v_code]
        extra += overhead_bytes(batch, sides, (l.k_rank, l.v_rank), 4)
        extra_bits += 8 * overhead_bytes(batch, sides, (l.k_rank, l.v_rank), 2)  # floats at 16
    assert cache.cache_bytes() == batch * max_len * plan.cache_bytes_per_token(4)[1] + extra
    assert cache.cache_bits() == batch * max_len * plan.bits_per_token(16) + extra_bits
    assert cache.cached_values() == batch * max_len * plan.cache_elements_per_token()[0]
    quantized = [l for l in cache.layers if isinstance(getattr(l, "k_store", None), IntegerStaticStore)
                 or isinstance(getattr(l, "v_store", None), IntegerStaticStore)]
    assert quantized and len(quantized) == sum(1 for l in plan.layers if l.k_code or l.v_code)


# ---------------------------------------------------------------- compiled

def compiled_generate(model, backend, ids, mask, new_tokens):
    """``generate`` with ``model.compile(backend=...)``: per graph the backend received, its
    ``lorc::dequantize`` nodes as dynamo traced them (codes, users); the graph breaks; the
    output."""
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def spy(gm, example_inputs):
        graphs.append([(n.args[:3], list(n.users)) for n in gm.graph.nodes
                       if n.target is DEQUANTIZE])
        return backend(gm, example_inputs)

    model.compile(backend=spy)
    try:
        got = generate(model, ids, mask, "static", new_tokens=new_tokens)
    finally:
        model._compiled_call_impl = None
        torch._dynamo.reset()
    return graphs, sum(counters["graph_break"].values()), got


def assert_traced_once(graphs, breaks, layers: int, latents: bool = True):
    """Prefill and decode: two graphs for every decode step, no break; each decode graph reads
    each quantized side as one ``lorc::dequantize`` of the cache's buffers, feeding the
    reconstruction directly (``latents``; a plain plan's feed attention)."""
    assert breaks == 0
    assert len(graphs) == 2
    dequantized = graphs[1]
    assert len(dequantized) == 2 * layers
    for args, users in dequantized:
        assert all(a.op == "placeholder" for a in args)
        if latents:
            assert [u.target for u in users] in ([RECONSTRUCT], [ROTATED_RECONSTRUCT])


@pytest.mark.parametrize("kind", ["commute", "reconstruct", "plain"])
def test_compiled_decode_traces_once_without_graph_breaks(kind):
    """Rewritten by the passes, run without Inductor: the same tokens as eager."""
    model = build(config_for("llama"))
    install(model, analysed(model), kind, 4, group=4)
    ids, mask = prompt()
    eager = generate(model, ids, mask, "static", new_tokens=8)
    backend = lorc_backend.with_options(inductor=False)
    graphs, breaks, got = compiled_generate(model, backend, ids, mask, 8)
    assert_traced_once(graphs, breaks, model.config.num_hidden_layers, kind != "plain")
    if kind != "plain":  # attention over the dequantized latents, absorbed
        assert sum(r.absorbed for r in backend.reports) > 0
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got.sequences, eager.sequences)


@pytest.mark.inductor
def test_inductor_decode_matches_eager():
    model = build(config_for("llama", layers=1))
    compress(model, 1.0, schedule="uniform", basis="weight", rope="commute", latent_bits=8,
             latent_group=4)
    ids, mask = prompt()
    eager = generate(model, ids, mask, "static", new_tokens=6)
    graphs, breaks, got = compiled_generate(model, lorc_backend, ids, mask, 6)
    assert_traced_once(graphs, breaks, 1)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(got.sequences, eager.sequences)


def test_a_model_compiled_in_place_gets_a_static_cache_where_none_is_chosen(caplog):
    """README's path (``model.compile``, then ``generate`` choosing no cache) builds a static
    latent cache, said once, and gives eager static's tokens; a later call asking more tokens
    reuses it (a whole number of ``STATIC_LENGTH_STEP`` slots) without tracing again;
    ``cache_implementation='dynamic'``, or an eager model, keeps the dynamic cache."""
    model = build(config_for("llama", layers=1))
    compress(model, 1.0, schedule="uniform", basis="weight", rope="commute", latent_bits=8,
             latent_group=4)
    ids, mask = prompt()
    eager = generate(model, ids, mask, "static", new_tokens=6)
    layer_of = lambda out: type(out.past_key_values.layers[0]).__name__  # noqa: E731
    assert layer_of(generate(model, ids, mask)) == "LatentDynamicLayer"
    torch._dynamo.reset()
    graphs, backend = [], lorc_backend.with_options(inductor=False)
    model.compile(backend=lambda gm, inputs: graphs.append(gm) or backend(gm, inputs))
    try:
        with caplog.at_level("WARNING", logger="lorc_fx.cache.install"):
            got = [generate(model, ids, mask, new_tokens=6) for _ in range(2)]
            traced = len(graphs)
            longer = generate(model, ids, mask, new_tokens=10)
            retraced = len(graphs) - traced
        dynamic = generate(model, ids, mask, "dynamic")
    finally:
        model._compiled_call_impl = None
        torch._dynamo.reset()
    eager_longer = generate(model, ids, mask, "static", new_tokens=10)  # after: it sizes later ones
    assert [layer_of(g) for g in got + [longer]] == ["LatentStaticLayer"] * 3
    assert all(torch.equal(g.sequences, eager.sequences) for g in got)
    assert torch.equal(longer.sequences, eager_longer.sequences)
    assert (traced, retraced) == (2, 0)  # prefill and decode, traced once for both lengths
    assert longer.past_key_values.layers[0].max_cache_len == STATIC_LENGTH_STEP
    said = [r.getMessage() for r in caplog.records if "static latent cache" in r.getMessage()]
    assert len(said) == 1 and "cache_implementation='dynamic'" in said[0]
    assert layer_of(dynamic) == "LatentDynamicLayer"
    assert model.generation_config.cache_implementation is None
