"""The latent cache behaves like transformers' own cache under every operation generate uses.

A hypothesis state machine drives random sequences of update / crop / beam reorder / batch
repeat / batch select / reset on a full-rank latent cache (keys cached before RoPE, with the
shared angle log, and values) and on a plain ``DynamicCache``, and after every step compares
what attention would read: the latent layer's reconstruction against the reference's keys
and values.
"""
import math

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import LlamaConfig
from transformers.cache_utils import DynamicCache, StaticCache

from lorc_fx.cache import LatentCache, LatentCodec

KV_HEADS, HEAD_DIM = 2, 8
WIDTH = KV_HEADS * HEAD_DIM
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
CONFIG = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, num_hidden_layers=1, vocab_size=16)


def orthonormal(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=gen, dtype=torch.float64))
    return q.T


def angles(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``(cos, sin)`` of shape ``(b, n, head_dim)`` for rotate-half RoPE."""
    freqs = positions[..., None].double() * INV_FREQ
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-b, a), dim=-1) * sin[:, None]


def latent_cache(rope_style: str | None, base) -> LatentCache:
    codec = LatentCodec(orthonormal(1), orthonormal(2), KV_HEADS, rope_style)
    return LatentCache.from_codecs(base, {0: codec})


def seen(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention reads from layer 0: the reference's K/V, or the latent reconstruction."""
    layer = cache.layers[0]
    if isinstance(cache, LatentCache):
        return layer.bases.expand(layer.keys, layer.values)
    return layer.keys, layer.values


class LatentCacheMachine(RuleBasedStateMachine):
    @initialize(pre_rope=st.booleans(), batch=st.integers(1, 3))
    def start(self, pre_rope, batch):
        self.latent = latent_cache("half" if pre_rope else None, DynamicCache(config=CONFIG))
        self.reference = DynamicCache(config=CONFIG)
        self.batch, self.pre_rope, self.step = batch, pre_rope, 0
        self.positions = torch.zeros(batch, dtype=torch.long)

    @rule(tokens=st.integers(1, 3))
    def update(self, tokens):
        self.step += 1
        gen = torch.Generator().manual_seed(self.step)
        shape = (self.batch, KV_HEADS, tokens, HEAD_DIM)
        keys = torch.randn(shape, generator=gen, dtype=torch.float64)
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
        positions = self.positions[:, None] + torch.arange(tokens)
        self.positions = self.positions + tokens
        cos, sin = angles(positions)
        keys = rope(keys, cos, sin)  # the cache receives post-RoPE keys, as in a model
        if self.latent.rotary is not None:
            self.latent.rotary.pending = (cos, sin)
        got = self.latent.update(keys, values, 0)
        want = self.reference.update(keys, values, 0)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)

    @precondition(lambda self: self.reference.get_seq_length() > 1)
    @rule(data=st.data())
    def crop(self, data):
        remove = data.draw(st.integers(1, self.reference.get_seq_length() - 1))
        self.latent.crop(-remove)
        self.reference.crop(-remove)
        self.positions = self.positions - remove

    @precondition(lambda self: self.reference.get_seq_length() > 0)
    @rule(data=st.data())
    def reorder(self, data):
        order = torch.tensor(data.draw(st.permutations(range(self.batch))))
        self.latent.reorder_cache(order)
        self.reference.reorder_cache(order)
        self.positions = self.positions[order]

    @precondition(lambda self: self.reference.get_seq_length() > 0 and self.batch <= 2)
    @rule(repeats=st.integers(1, 2))
    def repeat(self, repeats):
        self.latent.batch_repeat_interleave(repeats)
        self.reference.batch_repeat_interleave(repeats)
        self.positions = self.positions.repeat_interleave(repeats)
        self.batch *= repeats

    @precondition(lambda self: self.reference.get_seq_length() > 0 and self.batch > 1)
    @rule(data=st.data())
    def select(self, data):
        keep = sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1)))
        index = torch.tensor(keep)
        self.latent.batch_select_indices(index)
        self.reference.batch_select_indices(index)
        self.positions = self.positions[index]
        self.batch = len(keep)

    @rule()
    def reset(self):
        self.latent.reset()
        self.reference.reset()
        self.positions = torch.zeros(self.batch, dtype=torch.long)

    @invariant()
    def attention_reads_the_same(self):
        if not hasattr(self, "latent"):
            return
        assert self.latent.get_seq_length() == self.reference.get_seq_length()
        if self.reference.get_seq_length() == 0:
            return
        for got, want in zip(seen(self.latent), seen(self.reference)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        if self.latent.rotary is not None:
            # one row is the angles every row shares (positions computed once for the batch)
            rows, length = self.latent.rotary.angle.shape[:2]
            assert rows in (1, self.batch) and length == self.reference.get_seq_length()


TestLatentCacheMachine = LatentCacheMachine.TestCase
TestLatentCacheMachine.settings = settings(max_examples=40, stateful_step_count=12, deadline=None)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_static_latent_layer_matches_static_cache(pre_rope):
    """Writes at cache positions, in place, read back as the static reference reads them."""
    latent = latent_cache("half" if pre_rope else None, StaticCache(config=CONFIG, max_cache_len=8))
    reference = StaticCache(config=CONFIG, max_cache_len=8)
    gen = torch.Generator().manual_seed(0)
    position = 0
    for tokens in (3, 1, 2):
        keys, values = (torch.randn(2, KV_HEADS, tokens, HEAD_DIM, generator=gen,
                                    dtype=torch.float64) for _ in range(2))
        cos, sin = angles(torch.arange(position, position + tokens).expand(2, tokens))
        keys = rope(keys, cos, sin)
        if latent.rotary is not None:
            latent.rotary.pending = (cos, sin)
        kwargs = {"cache_position": torch.arange(position, position + tokens)}
        got = latent.update(keys, values, 0, kwargs)
        want = reference.update(keys, values, 0, kwargs)
        position += tokens
        for g, w in zip(got, want):
            torch.testing.assert_close(g[:, :, :position], w[:, :, :position], rtol=1e-9, atol=1e-9)
    layer = latent.layers[0]
    assert layer.keys.shape == (2, 1, 8, WIDTH)  # one latent row per position, preallocated
    expected = 2 * 2 * 8 * WIDTH * 8 + (2 * 8 * (HEAD_DIM // 2 + 1) * 8 if pre_rope else 0)
    assert latent.cache_bytes() == expected


def test_reduced_rank_keeps_the_projection_of_keys():
    """Below full rank the cache returns ``Bᵀ·P·k``: keys projected onto the kept rows."""
    basis = orthonormal(3)[:5]
    cache = LatentCache.from_codecs(DynamicCache(config=CONFIG),
                                    {0: LatentCodec(basis, basis, KV_HEADS)})
    keys = torch.randn(1, KV_HEADS, 4, HEAD_DIM, dtype=torch.float64)
    got, _ = cache.update(keys, keys, 0)
    flat = keys.transpose(1, 2).reshape(1, 4, WIDTH)
    want = (flat @ basis.T @ basis).reshape(1, 4, KV_HEADS, HEAD_DIM).transpose(1, 2)
    torch.testing.assert_close(got, want)
    assert cache.layers[0].keys.shape == (1, 1, 4, 5)
    assert math.isclose(cache.cache_bytes(), 2 * 4 * 5 * 8)
