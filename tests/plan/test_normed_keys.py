"""Keys behind a q/k norm (Gemma 3, Qwen 3, OLMo 2): the attention-aware basis is measured on
the keys attention reads, which are the keys the cache receives, so they compress too (a
post-RoPE latent, in either RoPE mode); at full rank generation stays exact."""
import pytest
import torch

from lorc_fx.api import compress
from lorc_fx.plan.options import CalibrationOptions
from helpers.families import build, config_for
from helpers.pass_helpers import assert_same_generation, compiled, generate
from helpers.tiny_llama import WORDS, save_tokenizer, write_text


@pytest.fixture(scope="module", params=["gemma3", "qwen3"])
def normed(request, tmp_path_factory):
    """A tiny Gemma 3 (q/k RMSNorm, a sliding and two full layers) or Qwen 3 (q/k RMSNorm,
    three full layers) saved with a tokenizer."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    config = config_for(request.param, layers=3)
    config.vocab_size = len(WORDS) + 3
    save_tokenizer(path)
    build(config).save_pretrained(path)
    return str(path), write_text(path / "text.txt")


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _prompt():
    ids = torch.tensor([[1, 5, 9, 4, 22, 7], [1, 3, 3, 8, 40, 11]])
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
def test_normed_keys_compress_with_the_attention_basis(normed, rope):
    path, text = normed
    model = _load(path)
    report = compress(model, 0.6, basis="attention", schedule="uniform", rope=rope, latent_bits=16,
                      calibration=CalibrationOptions(texts=(text,), tokens=1024, window=64))
    full_layers = [l for l in report.plan.layers if "kept full" not in l.note]  # not sliding
    assert len(full_layers) >= 2
    assert all(l.k_compressible and l.k_rank < l.k_full for l in full_layers)
    assert all(l.k_latent_of == "post_rope" and "behind a norm" in l.note for l in full_layers)


@pytest.mark.parametrize("rope", ["commute", "reconstruct"])
def test_normed_keys_at_full_rank_generate_exactly(normed, rope):
    path, text = normed
    model = _load(path)
    ids, mask = _prompt()
    expected = generate(model, ids, mask)
    compress(model, 1.0, basis="attention", schedule="uniform", rope=rope,
             calibration=CalibrationOptions(texts=(text,), tokens=1024, window=64))
    assert all(l.k_compressible for l in model._lorc_plan.layers if "kept full" not in l.note)
    assert_same_generation(generate(model, ids, mask), expected)
    from lorc_fx.compile.backend import lorc_backend

    with compiled(model, lorc_backend.with_options(inductor=False)):
        assert_same_generation(generate(model, ids, mask), expected)
