"""The absorbed form equals attention over reconstructed keys/values, on both of its paths (on
a GPU, the GPU suite's, also with CUDA tensors: the Triton kernel)."""
import pytest
import torch
import torch.nn.functional as F

from lorc_fx.compile.latent_attention import latent_attention
from lorc_fx.cache.latent_ops import reconstruct

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_latent_attention_equals_sdpa_over_reconstruction(heads, kv_heads, use_kernel, device):
    """``use_kernel=True`` on CPU runs ``lorc::latent_decode``'s torch path: the plumbing
    (mask shape, scale, squeeze/unsqueeze) the CUDA kernel receives."""
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
                           attn_mask=mask.to(device), scale=0.3, use_kernel=use_kernel)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-5, rtol=1e-5)
