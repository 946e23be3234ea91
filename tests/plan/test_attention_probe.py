"""The attention probe's moments against their definitions, computed the long way."""
import torch

from lorc_fx.plan.attention_probe import _Accumulator, _accumulate


def test_the_key_moment_is_the_weighted_spread_of_keys_about_their_attention_mean():
    """``keys = Σ over heads and positions Σ_n w_n (k_n − k̄)(k_n − k̄)ᵀ`` with
    ``w_n = p_n·‖v_n − o‖²`` and ``k̄ = Σ_n p_n k_n``, in cache coordinates (a head's key
    block embedded in the ``h_kv·d`` width), as :mod:`attention_probe` defines it."""
    gen = torch.Generator().manual_seed(0)
    b, h, h_kv, t, n, d = 2, 4, 2, 3, 5, 3
    query = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, h_kv, n, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, h_kv, n, d, generator=gen, dtype=torch.float64)
    p = torch.randn(b, h, t, n, generator=gen, dtype=torch.float64).softmax(-1)
    out = p @ value.repeat_interleave(h // h_kv, 1)
    acc = _Accumulator()
    _accumulate(acc, query, key, value, p, out)

    want = torch.zeros(h_kv * d, h_kv * d, dtype=torch.float64)
    keys = key.transpose(1, 2).reshape(b, n, h_kv * d)  # every head's key, side by side
    for i in range(b):
        for head in range(h):
            v = value[i, head // (h // h_kv)]
            for j in range(t):
                w = p[i, head, j] * ((v - out[i, head, j]) ** 2).sum(-1)
                mean = p[i, head, j] @ keys[i]
                centred = keys[i] - mean
                want += (centred.T * w) @ centred
    assert torch.allclose(acc.sums["keys"], want, rtol=1e-5, atol=1e-6)
