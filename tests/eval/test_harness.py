"""The compressed model under lm-evaluation-harness, on a tiny Llama and a local task (skipped
where lm_eval is not installed: it is the optional ``harness`` extra)."""
import json
import math
import re

import pytest
import torch

from lorc_fx.cli import main
from helpers.tiny_llama import save_tiny_llama, write_text

pytest.importorskip("lm_eval")

from lorc_fx.eval.harness import documents, harness_scores, write_task  # noqa: E402

WEIGHT_PLAN = dict(basis="weight", schedule="uniform", rope="commute", rank_multiple=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-harness")
    return save_tiny_llama(root / "model"), write_text(root / "text.txt")


def _word_perplexity(model, tok, docs, forward) -> float:
    """Each document scored in one window after the BOS prefix, as the harness does here."""
    total, words = 0.0, 0
    for doc in docs:
        ids = torch.tensor([[tok.bos_token_id, *tok.encode(doc)]])
        with torch.no_grad():
            logp = forward(ids)[0, :-1].double().log_softmax(-1)
        total += float(logp.gather(-1, ids[0, 1:, None]).sum())
        words += len(re.split(r"\s+", doc))
    return math.exp(-total / words)


def test_harness_scores_the_latent_cache_not_the_plain_forward(tiny, tmp_path):
    from lorc_fx.api import compress
    from lorc_fx.cache import latent_cache
    from lorc_fx.data.models import load_model, load_tokenizer

    directory, text = tiny
    model, tok = load_model(directory), load_tokenizer(directory)
    docs = documents(open(text).read(), 3, 40)
    task = write_task("tiny text", docs, tmp_path)
    assert task == "lorc_tiny_text" and (tmp_path / f"{task}.yaml").is_file()
    full = harness_scores(model, tok, task, tmp_path, compressed=False, max_length=128)

    compress(model, 1.0, **WEIGHT_PLAN)
    exact = harness_scores(model, tok, task, tmp_path, compressed=True, max_length=128)
    assert exact == pytest.approx(full, rel=1e-6)

    compress(model, 0.5, **WEIGHT_PLAN)
    lossy = harness_scores(model, tok, task, tmp_path, compressed=True, max_length=128)
    plain = _word_perplexity(model, tok, docs, lambda ids: model(ids, use_cache=False).logits)
    latent = _word_perplexity(model, tok, docs, lambda ids: model(
        ids, past_key_values=latent_cache(model), use_cache=True).logits)
    assert full["word_perplexity"] == pytest.approx(plain, rel=1e-5)
    assert lossy["word_perplexity"] == pytest.approx(latent, rel=1e-5)
    assert abs(latent / plain - 1) > 1e-3  # the two paths differ below full rank


def test_a_text_too_short_for_the_documents_is_refused():
    text = "\n\n".join(f"a b c {i}" for i in range(4))  # 3 paragraphs are evaluation's
    assert len(documents(text, 3, 3)) == 3
    with pytest.raises(ValueError, match="holds 3 documents of 3 words, fewer than the 4"):
        documents(text, 4, 3)


def test_cli_lm_eval_writes_both_sides(tiny, tmp_path, capsys):
    directory, text = tiny
    out = tmp_path / "harness.json"
    assert main(["lm-eval", "--model", directory, "--cache-fraction", "1.0", "--basis", "weight",
                 "--schedule", "uniform", "--rope", "commute", "--text", text, "--docs", "2",
                 "--doc-words", "40", "--max-length", "64", "--task-dir", str(tmp_path / "task"),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["documents"] == 2 and data["cache_fraction"] == 1.0
    assert data["compressed"] == pytest.approx(data["full"], rel=1e-6)
    assert "word_perplexity" in capsys.readouterr().out
