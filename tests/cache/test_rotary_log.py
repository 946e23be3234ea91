"""The RoPE angle log keeps an angle per pair and a magnitude per token, and hands back the
``(cos, sin)`` it was given."""
import pytest
import torch

from lorc_fx.cache.rotary import RotaryLog

ROTARY_DIM = 8


def hf_angles(positions: torch.Tensor, style: str, scaling: float, dtype: torch.dtype):
    """transformers' ``(cos, sin)`` ``(b, n, rotary_dim)``: each frequency's value repeated
    over its pair, times ``attention_scaling``."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, ROTARY_DIM, 2).float() / ROTARY_DIM)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1) if style == "half" else freqs.repeat_interleave(2, -1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("scaling", [1.0, 1.2])
def test_log_hands_back_what_it_was_given(style, dtype, tol, scaling):
    log = RotaryLog(style)
    positions = torch.tensor([[0, 1, 2, 3000], [7, 8, 9, 40000]])
    for chunk in positions.split([3, 1], dim=1):
        log.pending = hf_angles(chunk, style, scaling, dtype)
        log.append(None)
    want = hf_angles(positions, style, scaling, dtype)
    got = log.angles(4)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol)
    # an angle per pair and one magnitude per token: what Plan.rotary_log charges
    assert sum(t[0, 0].numel() for t in log.tensors()) == ROTARY_DIM // 2 + 1
    log.crop(-1)
    assert log.angles(3)[0].shape == (2, 3, ROTARY_DIM)


def test_static_log_is_written_at_positions():
    log = RotaryLog("half", max_cache_len=6)
    log.pending = hf_angles(torch.tensor([[4, 5]]), "half", 1.0, torch.float32)
    log.append(torch.tensor([4, 5]))
    cos, sin = log.angles(6)
    want = hf_angles(torch.tensor([[4, 5]]), "half", 1.0, torch.float32)
    torch.testing.assert_close(cos[:, 4:], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 4:], want[1], rtol=0, atol=1e-6)
    assert log.angle.shape[1] == 6


def test_pairs_of_different_magnitude_are_refused():
    log = RotaryLog("half")
    cos, sin = hf_angles(torch.tensor([[1, 2]]), "half", 1.0, torch.float32)
    log.pending = cos * torch.linspace(1, 2, ROTARY_DIM), sin * torch.linspace(1, 2, ROTARY_DIM)
    with pytest.raises(ValueError, match="differ in magnitude.*rope='commute'"):
        log.append(None)
