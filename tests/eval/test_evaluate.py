"""The evaluation refuses to report what it did not measure."""
import pytest
import torch

from lorc_fx.eval.evaluate import (PROMPT_TOKENS, EvalOptions, agreement, evaluation_inputs,
                                   prompts_from)


class WordTokenizer:
    """One token per word: enough to count prompt lengths."""

    def __call__(self, text, return_tensors=None):
        ids = [hash(w) % 1000 for w in text.split()]
        out = torch.tensor([ids]) if return_tensors == "pt" else ids
        return type("Encoding", (), {"input_ids": out})()


def _text(paragraphs: int, words: int) -> str:
    return "\n\n".join(" ".join(f"w{p}_{i}" for i in range(words)) for p in range(paragraphs))


def test_no_prompts_means_no_generation_figures():
    assert prompts_from(WordTokenizer(), _text(40, 50), 0) == []
    assert agreement([], []) == {"token_agreement": None, "exact_match": None,
                                 "mean_common_prefix": None}


def test_paragraphs_shorter_than_a_prompt_are_refused():
    short = _text(40, PROMPT_TOKENS - 1)
    with pytest.raises(ValueError, match="only 0 evaluation paragraphs"):
        prompts_from(WordTokenizer(), short, 2)
    assert len(prompts_from(WordTokenizer(), _text(40, PROMPT_TOKENS), 2)) == 2


def test_a_text_too_short_for_its_windows_is_refused_by_name():
    options = EvalOptions(text="tiny.txt", tokens=4096, window=512, prompts=1)
    with pytest.raises(ValueError, match="text 'tiny.txt': its evaluation part"):
        evaluation_inputs(WordTokenizer(), _text(40, 50), options)


def test_scores_measure_bits_per_value_from_the_cache():
    """Windows of whole latent groups: the bits per value measured over every batch are the
    plan's (floats at 16 bits), the full cache's 0."""
    from lorc_fx.api import compress
    from lorc_fx.eval.evaluate import score_windows
    from helpers.families import VOCAB, build, config_for

    model = build(config_for("llama"))
    report = compress(model, 0.5, schedule="uniform", basis="weight", rope="commute",
                      latent_bits=4, latent_group=8)
    windows = torch.randint(3, VOCAB, (3, 32), generator=torch.Generator().manual_seed(0))
    scores = score_windows(model, windows, True, batch_size=2)
    assert scores.bits_per_value == pytest.approx(report.plan.bits_per_value, rel=1e-12)
    assert report.plan.bits_per_value < 16 * 0.5 + 1e-9
    assert score_windows(model, windows, False).bits_per_value == 0.0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_decode_after_is_checked_by_name(bad):
    with pytest.raises(ValueError, match="decode_after must be an integer >= 1"):
        EvalOptions(decode_after=bad)
    assert EvalOptions(decode_after=None).scoring == "one forward per window"
    assert EvalOptions(window=64, tokens=64).prompt == 32  # at most half the window


def test_decoded_scores_read_the_cache_as_generate_does():
    """A full-width plan stores every key and value exactly: decoding the windows token by
    token after a prompt scores the tokens after it as the uncompressed model does, and one
    forward through the cache scores every token so, to float rounding; the next-token
    agreement and KL come with either."""
    from lorc_fx.api import compress
    from lorc_fx.eval.evaluate import score_windows
    from helpers.families import VOCAB, build, config_for

    model = build(config_for("llama"))
    compress(model, 1.0, schedule="uniform", basis="weight", rope="reconstruct")
    windows = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(0))
    one = score_windows(model, windows, True, reference=model)
    decoded = score_windows(model, windows, True, reference=model, prompt=5)
    assert one.ppl == pytest.approx(score_windows(model, windows, False).ppl, rel=1e-5)
    assert decoded.ppl == pytest.approx(score_windows(model, windows, False, prompt=5).ppl,
                                        rel=1e-5)
    assert decoded.ppl != pytest.approx(one.ppl, rel=1e-3)  # fewer tokens scored
    assert decoded.kl_mean == pytest.approx(0, abs=1e-7)
    assert one.kl_mean == pytest.approx(0, abs=1e-7)
    assert decoded.top1_agreement == one.top1_agreement == 1.0
