"""The absorbed form equals attention over reconstructed keys/values, on both of its paths (on
a GPU, the GPU suite's, also with CUDA tensors: the Triton kernel); keys cached before RoPE
score the same rebuilt or per rotary pair."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from lorc_fx.analysis.records import RopeLayout
from lorc_fx.cache.latent_ops import reconstruct, rotated_reconstruct
from lorc_fx.cache.rotary import frequency_pairs
from lorc_fx.compile.latent_attention import (latent_attention, per_frequency_scores,
                                              rotary_scores)
from lorc_fx.plan.spectra import real_spectrum, rope_commuting_spectrum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("path", ["sdpa", "heads as rows", "kernel"])
@pytest.mark.parametrize("device", DEVICES)
def test_latent_attention_equals_sdpa_over_reconstruction(heads, kv_heads, path, device):
    """``use_kernel=True`` on CPU runs ``lorc::latent_decode``'s torch path: the plumbing
    (mask shape, scale, squeeze/unsqueeze) the CUDA kernel receives; ``heads_as_rows``
    (decode steps) reads the query heads as rows of one head."""
    gen = torch.Generator().manual_seed(0)
    b, n, d, r_k, r_v = 3, 11, 8, 5, 7
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    k_basis = torch.linalg.qr(rand(kv_heads * d, r_k)).Q.T
    v_basis = torch.linalg.qr(rand(kv_heads * d, r_v)).Q.T
    c_k, c_v, q = rand(b, 1, n, r_k), rand(b, 1, n, r_v), rand(b, heads, 1, d)
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[1, ..., :3] = False  # left padding
    keys, values = reconstruct(c_k, k_basis, kv_heads), reconstruct(c_v, v_basis, kv_heads)
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.3,
                                              enable_gqa=True)
    on = lambda x: x.float().to(device)  # noqa: E731
    got = latent_attention(on(q), on(c_k), on(c_v), on(k_basis), on(v_basis), kv_heads,
                           attn_mask=mask.to(device), scale=0.3, use_kernel=path == "kernel",
                           heads_as_rows=path == "heads as rows")
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(style=st.sampled_from(["half", "interleaved"]), heads=st.sampled_from([(4, 2), (3, 1), (2, 2)]),
       t=st.integers(1, 3), keep=st.integers(0, 8), passthrough=st.booleans(),
       seed=st.integers(0, 99))
def test_pre_rope_keys_in_a_rope_commuting_basis_score_per_pair_as_rebuilt(
        style, heads, t, keep, passthrough, seed):
    """A RoPE-commuting basis (``plan.spectra``) cut at any of its valid ranks: each row lies
    on one rotary pair (``frequency_pairs``), and ``per_frequency_scores`` gives the scores of
    the keys rebuilt and rotated (``rotary_scores``, and SDPA's over ``rotated_reconstruct``);
    a basis whose rows mix pairs, or touch pass-through dims, is not taken for one."""
    (h, h_kv), d, b, n = heads, 8, 2, 7
    rotary_dim = 4 if passthrough else d
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    rope = RopeLayout(style, rotary_dim)
    spectrum = rope_commuting_spectrum(rand(h_kv * d, 16), h_kv, d, rope)
    rotary_rows = spectrum.rows.view(-1, h_kv, d)[..., rotary_dim:].abs().sum((1, 2)) == 0
    rank = 2 * (1 + keep % (rotary_dim // 2 * h_kv))  # whole pairs, as valid ranks cut
    basis = spectrum.rows[rotary_rows][:rank]
    pairs = frequency_pairs(basis, h_kv, rotary_dim, style)
    assert pairs is not None and len(pairs) == rank
    assert frequency_pairs(real_spectrum(rand(h_kv * d, 16)).rows, h_kv, rotary_dim, style) is None
    if passthrough:
        assert frequency_pairs(spectrum.rows, h_kv, rotary_dim, style) is None
    angles = rand(b, n, rotary_dim // 2) * 6
    per_dim = (lambda x: torch.cat((x, x), -1)) if style == "half" else \
        (lambda x: x.repeat_interleave(2, -1))
    cos, sin = per_dim(angles.cos()) * 1.1, per_dim(angles.sin()) * 1.1  # scaled, as YaRN's
    q, latent = rand(b, h, t, d), rand(b, 1, n, rank)
    got = per_frequency_scores(q, latent, cos, sin, basis, h_kv, style, pairs, scale=0.3)
    torch.testing.assert_close(got, rotary_scores(q, latent, cos, sin, basis, h_kv, style, 0.3))
    keys = rotated_reconstruct(latent, basis, h_kv, cos, sin, style, pairs)
    expected = q @ keys.repeat_interleave(h // h_kv, 1).transpose(-1, -2) * 0.3
    torch.testing.assert_close(got, expected)
