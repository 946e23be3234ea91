"""Next-token KL divergence of the compressed model from the full one, on a tiny Llama."""
import math

import pytest
import torch

from lorc_fx.eval.evaluate import EvalOptions, evaluate, next_token_kl, score_windows
from helpers.tiny_llama import save_tiny_llama, write_text

WEIGHT_PLAN = dict(basis="weight", schedule="uniform", rope="commute", rank_multiple=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lorc_fx.data.models import load_model, load_tokenizer

    root = tmp_path_factory.mktemp("tiny-kl")
    directory, text = save_tiny_llama(root / "model"), write_text(root / "text.txt")
    return load_model(directory), load_tokenizer(directory), open(text).read()


def _windows(seed=0, count=3, length=40):
    return torch.randint(3, 120, (count, length), generator=torch.Generator().manual_seed(seed))


def test_next_token_kl_is_the_textbook_sum():
    reference, other = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    p = [math.exp(x) / sum(math.exp(y) for y in reference.tolist()) for x in reference.tolist()]
    q = [math.exp(x) / sum(math.exp(y) for y in other.tolist()) for x in other.tolist()]
    expected = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert float(next_token_kl(reference, other)) == pytest.approx(expected, rel=1e-12)
    assert float(next_token_kl(reference, reference)) == 0.0


def test_kl_is_zero_when_nothing_is_dropped(tiny):
    from lorc_fx.api import compress

    model, _, _ = tiny
    compress(model, 1.0, **WEIGHT_PLAN)
    scores = score_windows(model, _windows(), True, reference=model)
    assert scores.top1_agreement == 1.0
    assert 0.0 <= scores.kl_mean < 1e-9


def test_kl_below_full_rank_matches_a_direct_computation(tiny):
    """Positive, and the mean over every next-token position of KL(full ‖ compressed)
    computed here from both forwards with torch's own kl_div."""
    from lorc_fx.api import compress
    from lorc_fx.cache import latent_cache

    model, _, _ = tiny
    compress(model, 0.5, **WEIGHT_PLAN)
    windows = _windows(seed=2)
    scores = score_windows(model, windows, True, batch_size=2, reference=model)
    with torch.no_grad():
        full = model(windows, use_cache=False).logits[:, :-1].double().log_softmax(-1)
        got = model(windows, past_key_values=latent_cache(model, prefill_as_stored=True),
                    use_cache=True).logits  # one forward, read back as stored
    got = got[:, :-1].double().log_softmax(-1)
    direct = (torch.nn.functional.kl_div(got, full, log_target=True, reduction="sum")
              / got[..., 0].numel())
    assert scores.kl_mean > 1e-4
    assert scores.kl_mean == pytest.approx(float(direct), rel=1e-5)
    assert scores.top1_agreement == pytest.approx(
        float((full.argmax(-1) == got.argmax(-1)).double().mean()))


def test_evaluate_reports_kl_beside_perplexity(tiny):
    from lorc_fx.api import compress

    model, tok, text = tiny
    options = EvalOptions(tokens=128, window=64, prompts=0)
    compress(model, 1.0, **WEIGHT_PLAN)
    exact = evaluate(model, tok, text, options)
    compress(model, 0.5, **WEIGHT_PLAN)
    lossy = evaluate(model, tok, text, options)
    assert exact.kl_mean < 1e-9 and exact.top1_agreement == 1.0
    assert lossy.kl_mean > 1e-4 and lossy.ppl_compressed != pytest.approx(lossy.ppl_full)
