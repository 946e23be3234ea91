"""Quantized latents (``latent_bits`` 8 or 4): the latent cache stores integer codes per
channel over groups of ``latent_group`` tokens, a full-precision residual window for the
group not yet full, and rebuilds K/V from the dequantized latents.

Tolerances on a tiny random llama (weights ~N(0, 0.02), logits ~0.5 at most): a b-bit code
keeps each latent within half a step, ``range / (2·(2**b - 1))`` of its channel's group, so
the latents move by ≈0.2% of their range at 8 bits and ≈3.3% at 4 bits (17× more); the
logits, a smooth function of them, move by about as much relative to their own scale.
Measured: 0.3% (8 bits) and 9% (4 bits) of the largest logit; the bounds below (1% and 25%)
leave ~3× room and still fail on a broken layer (a wrong group or channel is off by the
latent's whole range, ~100%).
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache

from lorc_fx.api import compress
from lorc_fx.cache import LatentCache, LatentCodec, latent_cache
from lorc_fx.cache.layers import PREFILL_TOKENS
from lorc_fx.cache.stores.integer import IntegerStore
from lorc_fx.codes.integer import QuantSpec
from lorc_fx.plan.options import PlanOptions
from helpers.families import VOCAB, build, config_for

KV_HEADS, HEAD_DIM = 2, 8
WIDTH = KV_HEADS * HEAD_DIM
CONFIG = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=16)


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama"))


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, **options):
    report = compress(model, 1.0, schedule="uniform", basis="weight", **options)
    cache = latent_cache(model, prefill_as_stored=True)  # one forward reads the codes
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True).logits
    return out, cache, report


# ---------------------------------------------------------------- options and refusals

@pytest.mark.parametrize("bad", [dict(latent_bits=2), dict(latent_bits=12), dict(latent_bits=8.0),
                                 dict(latent_group=0), dict(latent_bits=4, latent_group=3)])
def test_options_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PlanOptions(**bad)


# ---------------------------------------------------------------- the model's view

def test_16_bits_changes_nothing(model):
    ids = ids_of(2, 40)
    default, cache, report = logits(model, ids)
    explicit, cache16, report16 = logits(model, ids, latent_bits=16, latent_group=8)
    assert torch.equal(default, explicit)
    assert not any(isinstance(l.k_store, IntegerStore) for l in cache16.layers)
    assert cache.cache_bytes() == cache16.cache_bytes()
    assert report.cache_bytes_per_token() == report16.cache_bytes_per_token()
    assert isinstance(report16.cache_bytes_per_token()[1], int)


def test_logits_stay_close_to_the_unquantized_latent_cache(model):
    ids = ids_of(2, 64)
    reference, _, _ = logits(model, ids)
    scale = reference.abs().max()
    err8 = (logits(model, ids, latent_bits=8, latent_group=16)[0] - reference).abs().max() / scale
    err4 = (logits(model, ids, latent_bits=4, latent_group=16)[0] - reference).abs().max() / scale
    assert 0 < err8 < 0.01
    assert err8 < err4 < 0.25


@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
def test_a_prefill_attends_its_own_tokens_as_computed_and_decoding_reads_the_codes(model, rope):
    """A write of more than ``PREFILL_TOKENS`` tokens attends them as the model computed them
    (its logits are the uncompressed model's) while the cache stores them as 4-bit codes; the
    next step reads those codes. A shorter write, or ``prefill_as_stored``, reads its own
    tokens back as stored."""
    compress(model, 1.0, schedule="uniform", basis="weight", rope=rope, latent_bits=4,
             latent_group=16)
    ids = ids_of(2, PREFILL_TOKENS + 17)
    prompt, step = ids[:, :-1], ids[:, -1:]
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        cache = latent_cache(model)
        got = model(prompt, past_key_values=cache, use_cache=True).logits
        assert cache.bits_per_value() < 16  # stored as codes
        torch.testing.assert_close(got, plain[:, :-1], rtol=1e-5, atol=1e-5)
        decoded = model(step, past_key_values=cache, use_cache=True).logits[:, -1]
        assert 0 < (decoded - plain[:, -1]).abs().max() < 0.25 * plain.abs().max()
        stored = model(prompt, past_key_values=latent_cache(model, prefill_as_stored=True),
                       use_cache=True).logits
        assert (stored - plain[:, :-1]).abs().max() > 1e-3
        short = ids[:, :PREFILL_TOKENS]  # a decode-sized write: two groups coded, read so
        assert (model(short, past_key_values=latent_cache(model), use_cache=True).logits
                - plain[:, :PREFILL_TOKENS]).abs().max() > 1e-3


@pytest.mark.parametrize("bits, group, rope", [(8, 16, "commute"), (4, 32, "commute"),
                                               (4, 16, "reconstruct")])
def test_measured_bytes_are_the_plans(model, bits, group, rope):
    """Whole groups: the plan's bytes exactly. Otherwise the residual window's tokens (the
    last ``length mod group``) are held at the unquantized rate."""
    report = compress(model, 1.0, schedule="uniform", basis="weight", rope=rope,
                      latent_bits=bits, latent_group=group)
    dtype_bytes = report.dtype_bytes
    per_token = report.cache_bytes_per_token()[1]
    assert f"{bits}-bit codes" in str(report)
    unquantized = report.plan.cache_elements_per_token()[1] * dtype_bytes
    assert per_token < unquantized
    for batch, length in ((2, 2 * group), (1, 3 * group), (2, 2 * group + 5), (2, group - 1)):
        cache = latent_cache(model)
        # positions per row, as generate passes them (the RoPE angle log keeps the angles'
        # batch: one shared row when the model broadcasts its default positions)
        positions = torch.arange(length).expand(batch, length)
        with torch.no_grad():
            model(ids_of(batch, length), position_ids=positions, past_key_values=cache,
                  use_cache=True)
        whole = length // group * group
        expected = batch * (whole * per_token + (length - whole) * unquantized)
        assert cache.cache_bytes() == expected
        if length == whole:
            assert cache.cache_bytes() == batch * length * per_token


@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_generate_with_padding_and_beams(model, bits):
    ids = ids_of(2, 20, seed=1)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # second row left-padded
    compress(model, 1.0, schedule="uniform", basis="weight")
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
        compress(model, 1.0, schedule="uniform", basis="weight", latent_bits=bits, latent_group=8)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               num_beams=2, return_dict_in_generate=True)
    cache = got.past_key_values
    assert isinstance(cache.layers[0].k_store, IntegerStore)
    assert cache.layers[0].k_store.quantized is not None  # groups did fill and quantize
    assert got.sequences.shape == reference.sequences.shape
    first, want = got.logits[0], reference.logits[0]  # same prompt: the prefill's logits
    assert ((first - want).abs().max() / want.abs().max()) < (0.01 if bits == 8 else 0.25)
    if bits == 8:
        assert torch.equal(got.sequences, reference.sequences)
    assert beams.sequences.shape == (2, 26)
    length = cache.get_seq_length()
    cache.crop(-5)
    assert cache.get_seq_length() == length - 5


# ---------------------------------------------------------------- the layer

def orthonormal_rows(rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=gen))
    return q.T[:rank].contiguous()


def half_step_error(store: IntegerStore, got: torch.Tensor, exact: torch.Tensor) -> None:
    """Quantized tokens within half their group's step (plus float32 rounding of
    ``zero + code·scale``); the residual window exact."""
    quant = None if store is None else store.quantized
    n = 0 if quant is None else quant.shape[-2]
    assert torch.equal(got[..., n:, :], exact[..., n:, :])
    if quant is None:
        return
    g = store.group
    step = quant.scale.float().repeat_interleave(g, dim=-1).transpose(-1, -2)  # (b, 1, n, r)
    zero = quant.zero.float().repeat_interleave(g, dim=-1).transpose(-1, -2)
    slack = 4 * torch.finfo(torch.float32).eps * (zero.abs() + step * (2 ** quant.spec.bits - 1))
    err = (got[..., :n, :] - exact[..., :n, :]).abs()
    assert bool((err <= step / 2 + slack).all()), float((err - step / 2).max())


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 4, 6, 8, 16]),
       k_rank=st.integers(0, WIDTH), v_rank=st.integers(1, WIDTH), batch=st.integers(1, 3),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 99),
       ops=st.lists(st.sampled_from(["crop", "reorder", "select", "repeat"]), max_size=3))
def test_layer_round_trip_within_half_a_step(bits, group, k_rank, v_rank, batch, chunks, seed,
                                             ops):
    spec = QuantSpec.per_channel(bits, group)
    codec = LatentCodec(orthonormal_rows(k_rank, seed), orthonormal_rows(v_rank, seed + 1), KV_HEADS)
    specs = tuple(spec if rank else None for rank in (k_rank, v_rank))
    cache = LatentCache.from_codecs(DynamicCache(config=CONFIG), {0: codec}, {0: specs})
    layer = cache.layers[0]
    assert all(isinstance(s, IntegerStore) == bool(r)
               for s, r in ((layer.k_store, k_rank), (layer.v_store, v_rank)))
    gen = torch.Generator().manual_seed(seed)
    exact_k, exact_v = [], []
    for i, tokens in enumerate(chunks):
        shape = (batch, KV_HEADS, tokens, HEAD_DIM)
        # channels of very different ranges, as a latent's are
        keys = torch.randn(shape, generator=gen) * (i + 1)
        values = torch.randn(shape, generator=gen) * 3
        got_k, got_v = cache.update(keys, values, 0)
        k, v = codec.compress(keys, values)
        exact_k.append(k)
        exact_v.append(v)
        ek, ev = torch.cat(exact_k, dim=-2), torch.cat(exact_v, dim=-2)
        lk, lv = layer.latents()
        half_step_error(layer.k_store if k_rank else None, lk, ek)
        half_step_error(layer.v_store, lv, ev)
        torch.testing.assert_close(got_k, codec.expand(lk, lv)[0])
        torch.testing.assert_close(got_v, codec.expand(lk, lv)[1])
    length = sum(chunks)
    assert cache.get_seq_length() == length
    whole = length // group * group
    packed = sum(r * whole * bits // 8 + 2 * r * (whole // group) * 4 + r * (length - whole) * 4
                 for r in (k_rank, v_rank))
    assert cache.cache_bytes() == batch * packed  # float32: 4-byte scales, zeros, window
    # batch and crop ops act on the dequantized latents as on a plain tensor
    for op in ops:
        before_k, before_v = layer.latents()
        if op == "crop" and length > 1:
            remove = 1 + seed % (length - 1)
            cache.crop(-remove)
            length -= remove
            index = lambda t: t[..., :length, :]
        elif op == "reorder":
            order = torch.randperm(batch, generator=gen)
            cache.reorder_cache(order)
            index = lambda t: t[order]
        elif op == "select" and batch > 1:
            keep = torch.tensor([0, batch - 1])
            cache.batch_select_indices(keep)
            batch = 2
            index = lambda t: t[keep]
        elif op == "repeat" and batch < 3:
            cache.batch_repeat_interleave(2)
            batch *= 2
            index = lambda t: t.repeat_interleave(2, dim=0)
        else:
            continue
        after_k, after_v = layer.latents()
        assert torch.equal(after_k, index(before_k)) and torch.equal(after_v, index(before_v))
        assert cache.get_seq_length() == length
        quantized = layer.k_store.quantized if k_rank else None
        if quantized is not None:  # only whole groups stay quantized
            assert quantized.shape[-2] % group == 0 and \
                layer.k_store.window_tokens(layer.keys).shape[-2] < group
    # and it keeps growing after them
    more = torch.randn(batch, KV_HEADS, group, HEAD_DIM, generator=gen)
    cache.update(more, more, 0)
    assert cache.get_seq_length() == length + group
    assert k_rank == 0 or layer.k_store.window_tokens(layer.keys).shape[-2] < group


def test_values_beside_unquantized_keys_settle_whole_groups():
    """Keys kept raw (behind a norm) hold every token in their window; the values' groups
    are still settled by the values' own window, whole groups only."""
    spec = QuantSpec.per_channel(8, 2)
    codec = LatentCodec(None, orthonormal_rows(5, 0), KV_HEADS)
    cache = LatentCache.from_codecs(DynamicCache(config=CONFIG), {0: codec}, {0: (None, spec)})
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    exact = []
    for _ in range(5):
        states = torch.randn(1, KV_HEADS, 1, HEAD_DIM, generator=gen)
        cache.update(states, states, 0)
        exact.append(codec.compress(states, states)[1])
        half_step_error(layer.v_store, layer.latents()[1], torch.cat(exact, dim=-2))
    keys, values = layer.keys, layer.v_store.window_tokens(layer.values)
    assert layer.v_store.quantized.shape[-2] == 4 and values.shape[-2] == 1 and keys.shape[-2] == 5


# ---------------------------------------------------------------- mixed plans: bytes measured

@pytest.fixture(scope="module")
def mixed(model):
    from lorc_fx.analysis import analyze
    from lorc_fx.analysis.records import named_params
    from lorc_fx.plan.planner import layer_inputs

    blocks = analyze(model)
    return blocks, layer_inputs(named_params(model), blocks)


@settings(max_examples=12, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([2, 4, 8, 16]),
       budget=st.floats(3.0, 14.0), rope=st.sampled_from(["commute", "reconstruct"]),
       keep_first=st.integers(0, 1), plain=st.booleans(), groups=st.integers(1, 3))
def test_measured_bits_are_the_plans_for_mixed_plans(model, mixed, bits, group, budget, rope,
                                                     keep_first, plain, groups):
    """Quantized latents beside 16-bit (here float32) sides: a layer kept full, the RoPE angle
    log, or plain quantization's full-width identity bases. On whole groups the cache's
    tensors hold exactly the plan's bytes, and its bits per value (floats at 16 bits) are
    the plan's."""
    from lorc_fx.plan.planner import plain_quantized_plan, plan_layers
    from lorc_fx.plan.schedules import UnreachableFraction

    blocks, inputs = mixed
    options = PlanOptions(bits_per_value=budget, latent_bits=bits, latent_group=group,
                          schedule="uniform", basis="weight", rope=rope, keep_first=keep_first)
    try:
        plan = plain_quantized_plan(inputs, options) if plain else plan_layers(inputs, options)
    except UnreachableFraction:
        return
    compress(model, plan=plan, blocks=blocks)
    length = groups * group
    cache = latent_cache(model)
    with torch.no_grad():
        model(ids_of(1, length, seed=groups), past_key_values=cache, use_cache=True)
    assert cache.cache_bytes() == length * plan.cache_bytes_per_token(4)[1]
    assert cache.cached_values() == length * plan.cache_elements_per_token()[0]
    assert cache.bits_per_value() == pytest.approx(plan.bits_per_value, rel=1e-12)
    assert any(isinstance(getattr(l, "k_store", None), IntegerStore) for l in cache.layers)


def test_sixteen_bit_latents_measure_sixteen_bits_per_value_at_full_width(model):
    """The unquantized identity plan of a float32 model: 16 bits per value (floats counted
    at 16), its bytes those of the full cache."""
    compress(model, 1.0, schedule="uniform", basis="weight", rope="commute")
    cache = latent_cache(model)
    with torch.no_grad():
        model(ids_of(2, 12), past_key_values=cache, use_cache=True)
    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids_of(2, 12), past_key_values=plain, use_cache=True)
    assert cache.bits_per_value() == 16.0
    assert cache.cache_bytes() == sum(l.keys.nbytes + l.values.nbytes for l in plain.layers)
