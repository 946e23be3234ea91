"""``LatentSlidingLayer``: a sliding-window (or chunked) cache layer over stores mirrors
transformers' ``DynamicSlidingWindowLayer`` step for step (what ``update`` returns, what it
keeps, ``get_seq_length``, ``get_mask_sizes``, crop with past recording, beams and batch
repeat/select): exactly with keys and values kept full, within the codes' rounding with
plain integer codes, which it drops in whole groups and counts as it holds them."""
import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from lorc_fx.cache import LatentCodec, LatentSlidingLayer, LatentStaticSlidingLayer
from lorc_fx.codes.integer import QuantSpec

WINDOW, GROUP, HEADS, DIM = 6, 4, 2, 8
# a prefill within the window, decode steps past it, a prefill longer than the window
STEPS = (3, 1, 1, 1, 1, 1, 9, 1, 1, 2, 1)


def _codes(bits: int = 8):
    """Keys per channel in groups of GROUP tokens, values per token."""
    return QuantSpec.per_channel(bits, GROUP), QuantSpec.per_token(bits, DIM)


def _layers(coded: bool):
    codes = _codes() if coded else (None, None)
    return (DynamicSlidingWindowLayer(WINDOW),
            LatentSlidingLayer(WINDOW, LatentCodec(None, None, HEADS), *codes))


def _static_layer(max_cache_len: int, window: int, bits: int = 8) -> LatentStaticSlidingLayer:
    return LatentStaticSlidingLayer(max_cache_len, window, LatentCodec(None, None, HEADS),
                                    *_codes(bits))


def _states(tokens: int, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, HEADS, tokens, DIM, generator=g),
            torch.randn(batch, HEADS, tokens, DIM, generator=g))


def _same(got, expected, coded: bool):
    if coded:  # 8-bit codes of N(0, 1) values: within half a step of a range of ~6
        torch.testing.assert_close(got, expected, atol=0.03, rtol=0)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("coded", [False, True])
def test_updates_return_and_keep_what_transformers_sliding_layer_does(coded):
    reference, layer = _layers(coded)
    extra = 0
    for step, tokens in enumerate(STEPS):
        assert layer.get_mask_sizes(tokens) == reference.get_mask_sizes(tokens)
        k, v = _states(tokens, step)
        want_k, want_v = reference.update(k, v)
        got_k, got_v = layer.update(k, v)
        assert got_k.shape == want_k.shape
        _same(got_k, want_k, coded)
        _same(got_v, want_v, coded)
        assert layer.get_seq_length() == reference.get_seq_length()
        held = layer.held()
        # what it holds: the window, and as codes at most G - 1 older tokens (whole groups)
        assert reference.keys.shape[-2] <= held <= reference.keys.shape[-2] + (GROUP - 1) * coded
        extra = max(extra, held - reference.keys.shape[-2])
        tensors = layer.tensors()
        if not coded:
            assert sum(t.numel() for t in tensors) == sum(
                t.numel() for t in (reference.keys, reference.values))
    assert extra == (GROUP - 1) * coded  # the codes were dropped in whole groups


@pytest.mark.parametrize("coded", [False, True])
def test_crop_with_past_recording_beams_and_batch_select_follow_transformers(coded):
    reference, layer = _layers(coded)
    for l in (reference, layer):
        l.activate_past_recording()
    for step, tokens in enumerate((3, 5, 1, 2)):
        k, v = _states(tokens, step)
        for l in (reference, layer):
            l.update(k, v)
    for crop in (-2, 0):
        for l in (reference, layer):
            l.crop(crop)
        assert layer.get_seq_length() == reference.get_seq_length()
        assert layer.get_mask_sizes(1) == reference.get_mask_sizes(1)
    beams = torch.tensor([1, 0])
    for l in (reference, layer):
        l.reorder_cache(beams)
        l.batch_repeat_interleave(2)
        l.batch_select_indices(torch.tensor([0, 3]))
    k, v = _states(1, 99)
    want_k, want_v = reference.update(k, v)
    got_k, got_v = layer.update(k, v)
    assert got_k.shape == want_k.shape
    _same(got_k, want_k, coded)
    _same(got_v, want_v, coded)


def test_without_past_recording_a_full_window_refuses_crop_as_transformers_does():
    reference, layer = _layers(True)
    k, v = _states(WINDOW + 1, 0)
    for l in (reference, layer):
        l.update(k, v)
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            l.crop(-1)


def test_reset_empties_the_layer():
    _, layer = _layers(True)
    layer.update(*_states(9, 0))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.held() == 0
    k, v = _states(2, 1)
    got, _ = layer.update(k, v)
    assert got.shape[-2] == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_a_static_sliding_layer_returns_what_transformers_static_sliding_layer_does(bits):
    """The ring buffer of codes against transformers' ``StaticSlidingWindowLayer``: the same
    mask sizes and lengths, what ``update`` returns within the codes' rounding (on the
    positions the mask lets through), beams, and reset."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    reference = StaticSlidingWindowLayer(32, WINDOW)
    layer = _static_layer(32, WINDOW, bits)
    atol = 0.02 if bits == 8 else 0.25
    # fills, decodes past the window, continues with 9 and 13 tokens (read back), and
    # prefills 40 (as computed: more than PREFILL_TOKENS, from an unaligned position)
    for step, tokens in enumerate((3, 1, 1, 1, 1, 1, 1, 9, 1, 1, 2, 1, 13, 1, 40, 1, 1) * 2):
        if step == 14:
            for l in (reference, layer):
                l.reorder_cache(torch.tensor([1, 0]))
        assert layer.get_mask_sizes(tokens) == reference.get_mask_sizes(tokens)
        visible = min(reference.get_seq_length() + tokens, WINDOW) \
            if reference.get_seq_length() + tokens <= WINDOW else None
        k, v = _states(tokens, step)
        want_k, want_v = reference.update(k, v)
        got_k, got_v = layer.update(k, v)
        assert got_k.shape == want_k.shape and got_v.shape == want_v.shape
        n = want_k.shape[-2] if visible is None else visible
        torch.testing.assert_close(got_k[..., :n, :], want_k[..., :n, :], atol=atol, rtol=0)
        torch.testing.assert_close(got_v[..., :n, :], want_v[..., :n, :], atol=atol, rtol=0)
        assert layer.get_seq_length() == reference.get_seq_length()
    assert layer.ring == 16  # the window (6) in whole groups of 4, and two groups more
    layer.reset()
    assert layer.get_seq_length() == 0 and int(layer.position) == 0


def test_a_static_sliding_prefill_past_the_window_writes_what_it_keeps_once_a_side(monkeypatch):
    """A prefill writes the tokens its window keeps in one write a side, not one per group:
    a compiled prefill's graph holds one write a layer however long the window."""
    layer = _static_layer(64, 24)
    writes = []  # the tokens of each write

    def counted(write):
        def counted_write(window, states, positions, start):
            writes.append(states.shape[-2])
            write(window, states, positions, start)
        return counted_write

    for store in (layer.k_store, layer.v_store):
        monkeypatch.setattr(store, "write", counted(store.write))
    k, v = _states(45, 0)
    got_k, got_v = layer.update(k, v)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)  # a prefill reads its own as computed
    assert writes == [25, 25]  # from the last whole group the window of 24 reaches: 20..44
    next_k, next_v = _states(1, 1)
    got_k, _ = layer.update(next_k, next_v)  # the window's last 23 as stored, then the new one
    torch.testing.assert_close(got_k, torch.cat([k[..., 22:, :], next_k], dim=-2), atol=0.03,
                               rtol=0)


@pytest.mark.parametrize("before", [0, 3, 26])
def test_a_static_sliding_prefill_stores_what_writing_it_a_group_at_a_time_stores(before):
    """After the one write the decode steps read, bit for bit, what they read after all the
    prefill's tokens written G at a time (the read-back path of ``prefill_as_stored``; slots
    no window reads differ): a group's codes depend on its tokens alone, and no group the
    write stages lands on a slot the window still reads (from an empty layer, from within a
    group, from past the window)."""
    one, pieces = _static_layer(64, 24), _static_layer(64, 24)
    pieces.prefill_as_stored = True
    for seed, tokens in enumerate((before, 47)):
        if tokens:
            for layer in (one, pieces):
                layer.update(*_states(tokens, seed))
    for seed in (2, 3):  # a decode step reads the window's last 23 tokens and its own
        read_one, read_pieces = (layer.update(*_states(1, seed)) for layer in (one, pieces))
        assert read_one[0].shape[-2] == 24
        assert all(torch.equal(a, b) for a, b in zip(read_one, read_pieces))


def test_a_static_cache_codes_a_sliding_layer_in_a_ring_and_keeps_a_full_one_as_built():
    from transformers import Gemma3TextConfig
    from transformers.cache_utils import StaticCache, StaticSlidingWindowLayer

    from lorc_fx.cache import LatentCache

    config = Gemma3TextConfig(num_hidden_layers=1, layer_types=["sliding_attention"],
                              sliding_window=4, num_key_value_heads=HEADS, head_dim=DIM)
    bases = {0: LatentCodec(None, None, HEADS)}
    codes = {0: _codes()}
    coded = LatentCache.from_codecs(StaticCache(config=config, max_cache_len=16), bases, codes)
    assert type(coded.layers[0]) is LatentStaticSlidingLayer
    kept = LatentCache.from_codecs(StaticCache(config=config, max_cache_len=16), bases)
    assert type(kept.layers[0]) is StaticSlidingWindowLayer
