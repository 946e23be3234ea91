"""Retrieval tasks: prompts placed and sized as asked, scored and bounded right."""
import json
import re

import pytest
import torch

from lorc_fx.data.retrieval_tasks import (DISTRACTORS, HEADER, NEW_TOKENS, NOISE, TASKS, Sample,
                                          make_samples)
from lorc_fx.eval.retrieval import accuracy, is_correct, same_answer, wilson_interval


class WordTokenizer:
    """One token per whitespace-separated word."""

    def __call__(self, text, return_tensors=None):
        ids = [len(w) for w in text.split()]
        return type("Encoding", (), {"input_ids": torch.tensor([ids]) if return_tensors else ids})()


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_prompts_other_seed_others(task):
    tok = WordTokenizer()
    first, again = make_samples(tok, task, 300, 3, seed=1), make_samples(tok, task, 300, 3, seed=1)
    assert [s.prompt for s in first] == [s.prompt for s in again]
    other = make_samples(tok, task, 300, 3, seed=2)
    assert all(a.prompt != b.prompt and a.answer != b.answer for a, b in zip(first, other))
    assert len({s.prompt for s in first}) == 3  # each trial its own prompt


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [200, 1000])
def test_prompt_fills_the_length_and_the_needle_sits_at_its_depth(task, length):
    """Whitespace tokens: the prompt leaves room for the answer, and one more filler sentence
    (at most 8 words) would not have fit; the needle's share of the filler before it is the
    depth asked, to a sentence and the facts' words."""
    for s in make_samples(WordTokenizer(), task, length, 5, seed=0):
        budget = length - NEW_TOKENS
        assert budget - 8 < len(s.input_ids) <= budget
        question = s.prompt[s.prompt.rindex("\n\n"):]
        body = _words(s.prompt) - _words(HEADER) - _words(question)
        before = _words(s.prompt[:s.needle_char]) - _words(HEADER)
        assert abs(before / body - s.depth) <= (8 + 12 * 4) / body, (s.depth, before, body)
        assert s.prompt.count(s.answer) == (2 if task == "passkey" else 1)


def test_the_question_asks_the_needle_not_a_distractor():
    multi = make_samples(WordTokenizer(), "multikey", 400, 1, seed=3)[0]
    name = re.search(r"pass key of the (\w+ \w+)\?", multi.prompt).group(1)
    assert f"The pass key of the {name} is {multi.answer}." in multi.prompt
    assert multi.prompt[multi.needle_char:].startswith(f"The pass key of the {name} is")
    assert len(set(re.findall(r"\b\d{5}\b", multi.prompt))) == 4  # 3 distractors
    hops = make_samples(WordTokenizer(), "vartrack", 400, 1, seed=3)[0]
    asked = re.search(r"value of VAR (\w+)\?", hops.prompt).group(1)
    source = re.search(rf"VAR {asked} = (\w+)\.", hops.prompt).group(1)
    assert f"VAR {source} = {hops.answer}." in hops.prompt
    assert hops.prompt.index(f"VAR {source} =") < hops.prompt.index(f"VAR {asked} =")
    relay = make_samples(WordTokenizer(), "relay", 400, 1, seed=3)[0]
    asked = re.search(r"What number does the (\w+ \w+) have\?", relay.prompt).group(1)
    source = re.search(rf"The {asked} has the same number as the (\w+ \w+)\.",
                       relay.prompt).group(1)
    assert relay.prompt[relay.needle_char:].startswith(f"The {source} keeps the number "
                                                       f"{relay.answer}.")
    assert relay.prompt.index(f"The {source} keeps") < relay.prompt.index(f"The {asked} has")
    assert len(set(re.findall(r"\b\d{5}\b", relay.prompt))) == 2  # the distractor chain's


@pytest.mark.parametrize("task", TASKS)
def test_each_fact_span_holds_one_fact_sentence_and_the_question_none(task):
    """``Sample.facts`` (what a diagnosis reads exact) are whole fact sentences, the needle
    first, as many as the task hides, none overlapping another or the question."""
    hidden = {"passkey": 1, "multikey": 1 + DISTRACTORS, "relay": 4, "vartrack": 4}[task]
    for s in make_samples(WordTokenizer(), task, 300, 5, seed=2):
        texts = [s.prompt[a:b] for a, b in s.facts]
        assert len(texts) == hidden
        assert all(t.startswith(("The ", "VAR ")) and t.endswith(".") for t in texts)
        assert s.answer in texts[0]
        body = s.prompt[:s.prompt.rindex("\n\n")]
        assert sorted(re.findall(r"\b\d{5}\b", " ".join(texts))) == sorted(
            re.findall(r"\b\d{5}\b", body))  # every key sits in a fact
        assert all(b <= c for (_, b), (c, _) in zip(sorted(s.facts), sorted(s.facts)[1:]))
        assert max(b for _, b in s.facts) < s.prompt.rindex("\n\n")


@pytest.mark.parametrize("task", TASKS)
def test_a_text_haystack_holds_the_same_facts_among_the_texts_sentences(task, tmp_path):
    """With a text for haystack the facts, the question and the answer are the noise
    haystack's; the filler is the text's evaluation part (every 4th paragraph is
    calibration's), sentence after sentence from a seeded start, and the prompt still fills
    its length."""
    paragraphs = [" ".join(f"Paragraph {p} says thing {i}." for i in range(6)) for p in range(40)]
    text = tmp_path / "prose.txt"
    text.write_text("\n\n".join(paragraphs))
    tok = WordTokenizer()
    noise = make_samples(tok, task, 600, 3, seed=5)
    prose = make_samples(tok, task, 600, 3, seed=5, haystack=str(text))
    for n, p in zip(noise, prose, strict=True):
        assert (p.answer, p.depth) == (n.answer, n.depth)
        assert p.prompt[p.prompt.rindex("\n\n"):] == n.prompt[n.prompt.rindex("\n\n"):]
        assert p.prompt[p.needle_char:].split(".")[0] == n.prompt[n.needle_char:].split(".")[0]
        assert 600 - NEW_TOKENS - 8 < len(p.input_ids) <= 600 - NEW_TOKENS
        assert not any(sentence in p.prompt for sentence in NOISE)
        said = [int(x) for x in re.findall(r"Paragraph (\d+) says", p.prompt)]
        assert said and all(x % 4 for x in said)  # never a calibration paragraph
    assert len({p.prompt[len(HEADER):len(HEADER) + 40] for p in prose}) > 1  # seeded starts


def test_a_length_too_short_for_the_task_is_refused():
    with pytest.raises(ValueError, match="lengths: 20 tokens cannot hold a passkey prompt"):
        make_samples(WordTokenizer(), "passkey", 20, 1, seed=0)


def test_the_scorer_counts_the_first_number_written():
    samples = [Sample("passkey", 100, 0.5, "", [], answer, ()) for answer in ("12345", "67890")]
    assert accuracy(samples, [" 12345.", " 67890 is"]).correct == 2  # a perfect model
    assert accuracy(samples, [" 12345", " 12345"]).correct == 1  # a distractor's key
    assert accuracy(samples, [" none", "678901"]).correct == 0
    assert is_correct("12345", " is 12345, so") and not is_correct("12345", "1234 5")
    with pytest.raises(ValueError):
        accuracy(samples, ["12345"])  # an answer missing is an error, not a miss
    assert same_answer(" 4 apples", "4.") and same_answer("none", "no key")
    assert not same_answer("12345", "12346") and not same_answer("12345", "none")


@pytest.mark.parametrize("correct, trials, low, high", [
    (0, 10, 0.0, 0.27753), (10, 10, 0.72247, 1.0), (5, 10, 0.23659, 0.76341),
    (8, 10, 0.49016, 0.94331), (1, 50, 0.00354, 0.10495)])
def test_wilson_interval_on_known_values(correct, trials, low, high):
    assert wilson_interval(correct, trials) == pytest.approx((low, high), abs=1e-5)


def test_retrieval_end_to_end_on_a_tiny_model(tiny, tmp_path, monkeypatch, capsys):
    """``lorc eval --task`` plans, generates full and compressed on the same prompts and
    writes counts consistent with the outputs it records."""
    from lorc_fx.cli import main

    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "task.json"
    assert main(["eval", "--model", tiny[0], "--task", "multikey", "--lengths", "128,256",
                 "--trials", "3", "--seed", "4", "--cache-fraction", "0.5", "--latent-bits",
                 "16", "--basis", "weight", "--schedule", "uniform", "--rope", "commute",
                 "--json", str(out)]) == 0
    assert "multikey, greedy, 3 prompts per length" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert (data["task"], data["held_out"], data["lengths"]) == ("multikey", False, [128, 256])
    for row in data["results"]:
        assert row["prompt_tokens"] <= row["length"] - NEW_TOKENS
        for side in ("full", "compressed"):
            assert row[side]["trials"] == 3 == len(row["outputs"])
            assert row[side]["correct"] == sum(is_correct(o["answer"], o[side])
                                               for o in row["outputs"])
            low, high = row[side]["interval95"]
            assert 0 <= low <= row[side]["accuracy"] <= high <= 1
        assert row["same_answers"] == sum(same_answer(o["full"], o["compressed"])
                                          for o in row["outputs"])


@pytest.mark.parametrize("args, message", [
    (["--lengths", "32"], "--lengths must be integers >= 64"),
    (["--lengths", "1k,two"], "--lengths must be comma-separated integers (1k = 1024)"),
    (["--trials", "0"], "--trials must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--compile"], "--task scores greedy generate eagerly"),
    (["--haystack", "no-such-text"], "--haystack must be 'noise', a known text (news, "),
])
def test_task_options_are_refused_before_the_model_loads(tmp_path, args, message, capsys):
    from lorc_fx.cli import main

    assert main(["eval", "--model", str(tmp_path / "never-loaded"), "--task", "passkey",
                 *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "not a model directory" not in err


def test_a_length_beyond_the_context_limit_is_refused_before_planning(tiny, capsys):
    from lorc_fx.cli import main

    assert main(["eval", "--model", tiny[0], "--task", "passkey", "--lengths", "1k"]) == 2
    assert "--lengths must be in [64, 512] for this model" in capsys.readouterr().err


def test_one_prefill_for_every_cache_answers_as_generate_does(loaded):
    """``answers_sharing_prefill`` (the bench's long prompts: one forward writes every plan's
    cache) gives ``generate``'s answers, token for token, for the full cache and for plans
    whose keys are cached after RoPE and before it (an angle log handed by the hooks)."""
    import lorc_fx
    from lorc_fx.eval.retrieval import answers, answers_sharing_prefill

    model, tok, blocks, _ = loaded
    samples = make_samples(tok, "passkey", 160, 3, seed=0)
    common = dict(basis="weight", schedule="uniform", progress=False, blocks=blocks)
    plans = {"commute 4-bit": lorc_fx.compress(model, 0.3, latent_bits=4, rope="commute",
                                               **common).plan,
             "reconstruct": lorc_fx.compress(model, 0.5, latent_bits=16, rope="reconstruct",
                                             **common).plan}
    assert plans["reconstruct"].layers[0].k_latent_of == "pre_rope"
    shared = answers_sharing_prefill(model, tok, samples, plans, blocks)
    assert shared["full cache"] == answers(model, tok, samples, compressed=False)
    for name, plan in plans.items():
        lorc_fx.compress(model, plan=plan, blocks=blocks)
        assert shared[name] == answers(model, tok, samples, compressed=True), name
    assert shared["reconstruct"] != shared["full cache"]  # so a cache not read would show


def _rounded_cache(layers: int):
    """A cache of transformers' ``QuantizedLayer`` kind (a full-precision prefill handed back,
    a residual window, everything requantized as it fills) that rounds its keys and values
    to tenths and reads them back a tenth as large: a peer whose answers differ from the full
    cache's even on the tiny model."""
    from transformers.cache_utils import Cache, QuantizedLayer

    class Rounded(QuantizedLayer):
        def _quantize(self, tensor, axis):
            return (10 * tensor).round()

        def _dequantize(self, q_tensor):
            return q_tensor / 100

    return Cache(layers=[Rounded(residual_length=4) for _ in range(layers)])


def test_one_prefill_writes_a_peers_cache_that_answers_as_generate_does(loaded):
    """A peer's cache (``QuantizedCache``'s kind, in ``bench/retrieval.py``) written by the
    prefill the full cache shares answers as ``generate`` with that cache does."""
    from lorc_fx.eval.retrieval import answers_sharing_prefill

    model, tok, blocks, _ = loaded
    samples = make_samples(tok, "passkey", 160, 3, seed=0)
    layers = model.config.num_hidden_layers
    shared = answers_sharing_prefill(model, tok, samples, {}, blocks,
                                     {"rounded": lambda: _rounded_cache(layers)})
    for s, answer in zip(samples, shared["rounded"], strict=True):
        ids = torch.tensor([s.input_ids])
        seq = model.generate(ids, past_key_values=_rounded_cache(layers), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert answer == tok.decode(seq[0, ids.shape[1]:])
    assert shared["rounded"] != shared["full cache"]  # so a cache not read would show


def test_one_prefill_refuses_a_prompt_a_latent_cache_reads_back_as_stored(loaded):
    from lorc_fx.cache.layers import PREFILL_TOKENS
    from lorc_fx.eval.retrieval import answers_sharing_prefill

    model, tok, blocks, _ = loaded
    short = Sample("passkey", 64, 0.5, "", list(range(3, 3 + PREFILL_TOKENS)), "1", ())
    with pytest.raises(ValueError, match=f"prompts of more than {PREFILL_TOKENS} tokens"):
        answers_sharing_prefill(model, tok, [short], {}, blocks)
