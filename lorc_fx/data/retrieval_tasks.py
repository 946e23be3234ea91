"""Synthetic long-context retrieval prompts, generated offline and seeded (no file, no network).

- ``passkey``: one five-digit pass key hidden at a depth of filler text;
- ``multikey``: several named pass keys; the one asked sits at the depth, the others
  (distractors) at random depths;
- ``relay``: two hops in words (``The red fox keeps the number 12345.`` at the depth, ``The
  blue otter has the same number as the red fox.`` later, a second chain beside them as
  distractor); the number of the otter is asked;
- ``vartrack``: variable tracking over two hops (``VAR A = 12345`` at the depth, ``VAR B = A``
  later, a second chain beside them as distractor); the value of ``B`` is asked.

The filler (the haystack) is the passkey test's noise sentences repeated (``NOISE``, RULER's
"noise"), or with ``haystack`` a text's sentences in order (``lorc_fx.data.texts.load_text``:
its evaluation part, which calibration never reads), from a sentence the seed draws: real
prose, whose keys drift with position far less than the repeated sentences'
(bench/results/key_drift-cpu.md). Keys, names and the distractors' depths are drawn per prompt
from the seed, the same whatever the haystack. A prompt is sized with the model's
tokenizer so that it and its answer fit ``length`` tokens; each trial places the needle at
the next of ``depths``.

``lorc_fx.eval.retrieval`` scores caches on them; the planner's retrieval probe
(``search.retrieval_probe``) reads prompts of its own seed, never an evaluation's, and never
of ``HELD_OUT``, the family kept apart to report.
"""
from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from lorc_fx.data.texts import evaluation_part, load_text

TASKS = ("passkey", "multikey", "relay", "vartrack")
HELD_OUT = "vartrack"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the needle sits, as a share of the filler
NEW_TOKENS = 8  # generated per prompt: a five-digit answer in any tokenizer, and a margin
MIN_LENGTH = 64
DISTRACTORS = 3  # multikey: keys besides the one asked
NOISE_HAYSTACK = "noise"  # the default haystack: ``NOISE`` repeated

HEADER = ("A long text follows. Hidden in it are facts to remember; a question about them "
          "comes at the end.\n\n")
# the haystack of the passkey test (Mohtashami & Jaggi, 2023; RULER's "noise"), repeated: no
# fact in it, nothing a question could be mistaken for
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
         "There and back again.")
_ADJECTIVES = ("red", "blue", "green", "silver", "golden", "black", "white", "amber")
_NOUNS = ("heron", "falcon", "otter", "fox", "badger", "lynx", "raven", "salmon", "wolf",
          "hare")
_NAMES = [f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS]  # multikey's and relay's


@dataclass
class Sample:
    """One prompt of a task: its text and ids, the answer, and where its facts sit."""
    task: str
    length: int
    depth: float
    prompt: str
    input_ids: list[int]
    answer: str
    facts: tuple[tuple[int, int], ...]  # each fact's characters [start, end), the needle first

    @property
    def needle_char(self) -> int:
        """Where the needle (the asked key, or the chain's first step) begins."""
        return self.facts[0][0]

    def answer_ids(self, tokenizer) -> list[int]:
        """The answer's token ids as its text continues the prompt (``" " + answer``)."""
        return tokenizer(" " + self.answer, add_special_tokens=False).input_ids


@functools.cache
def text_sentences(name: str) -> tuple[str, ...]:
    """The sentences of text ``name``'s evaluation part (``load_text``; whitespace runs made
    one space), where a haystack reads them."""
    flat = re.sub(r"\s+", " ", evaluation_part(load_text(name))).strip()
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", flat) if s)


def _filler(count: int, haystack: str, rng: random.Random) -> list[str]:
    """``count`` filler sentences: ``NOISE`` repeated, or the text ``haystack``'s in order from
    a sentence ``rng`` draws, round again past its end."""
    if haystack == NOISE_HAYSTACK:
        return [NOISE[i % len(NOISE)] for i in range(count)]
    sentences = text_sentences(haystack)
    first = rng.randrange(len(sentences))
    return [sentences[(first + i) % len(sentences)] for i in range(count)]


def _number(rng: random.Random, taken: set[str]) -> str:
    while (n := str(rng.randrange(10_000, 100_000))) in taken:
        pass
    taken.add(n)
    return n


def _facts(task: str, depth: float, rng: random.Random) -> tuple[list[tuple[float, str]], str, str]:
    """The facts to hide as ``(depth, sentence)`` (the needle first), the question, and the
    answer."""
    taken: set[str] = set()
    if task == "passkey":
        key = _number(rng, taken)
        return ([(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")],
                "What is the pass key? The pass key is", key)
    if task == "multikey":
        names = rng.sample(_NAMES, DISTRACTORS + 1)
        keys = [_number(rng, taken) for _ in names]
        facts = [(depth if i == 0 else rng.random(), f"The pass key of the {name} is {key}.")
                 for i, (name, key) in enumerate(zip(names, keys))]
        return facts, f"What is the pass key of the {names[0]}? The pass key of the " \
                      f"{names[0]} is", keys[0]
    if task == "relay":
        names = rng.sample(_NAMES, 4)
        facts, value = _two_hops(names, depth, rng, taken,
                                 lambda name, n: f"The {name} keeps the number {n}.",
                                 lambda name, to: f"The {name} has the same number as the {to}.")
        return facts, f"What number does the {names[1]} have? The {names[1]} has the number", value
    names: list[str] = []
    while len(names) < 4:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        names += [] if name in names else [name]
    facts, value = _two_hops(names, depth, rng, taken, lambda name, n: f"VAR {name} = {n}.",
                             lambda name, to: f"VAR {name} = {to}.")
    return facts, f"What is the value of VAR {names[1]}? The value of VAR {names[1]} is", value


def _two_hops(names: list[str], depth: float, rng: random.Random, taken: set[str],
              holds: Callable[[str, str], str], links: Callable[[str, str], str]
              ) -> tuple[list[tuple[float, str]], str]:
    """Two chains of two hops over ``names`` A, B, C, D as ``(depth, sentence)``, the needle
    first: A ``holds`` the value at ``depth``, B ``links`` to A later; C holds another number
    and D links to C, both at random depths (the distractor). And A's value, which B asks."""
    a, b, c, d = names
    value, other = _number(rng, taken), _number(rng, taken)
    second, third = rng.random(), rng.random()
    return [(depth, holds(a, value)),
            (depth + (1 - depth) * rng.random(), links(b, a)),
            (min(second, third), holds(c, other)),
            (max(second, third), links(d, c))], value


def _assemble(filler: list[str], facts: list[tuple[float, str]], question: str
              ) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The prompt with each fact after ``round(depth * len(filler))`` filler sentences, and
    each fact's characters ``[start, end)`` in the order of ``facts``."""
    slots: dict[int, list[int]] = {}
    for i, (depth, _) in enumerate(facts):
        slots.setdefault(round(depth * len(filler)), []).append(i)
    parts, spans, written = [HEADER], {}, len(HEADER)
    for at in range(len(filler) + 1):
        for i in slots.get(at, []):
            spans[i] = (written, written + len(facts[i][1]))
            parts.append(facts[i][1] + " ")
            written += len(parts[-1])
        if at < len(filler):
            parts.append(filler[at] + " ")
            written += len(parts[-1])
    return "".join(parts) + "\n\n" + question, tuple(spans[i] for i in range(len(facts)))


def make_sample(tokenizer, task: str, length: int, depth: float, seed,
                haystack: str = NOISE_HAYSTACK) -> Sample:
    """One prompt of ``task`` whose ids and ``NEW_TOKENS`` answer tokens fit ``length``
    tokens, with as much filler of ``haystack`` as fits (found by bisection: tokenizers do
    not add up)."""
    rng = random.Random(f"{task}:{seed}")
    facts, question, answer = _facts(task, depth, rng)
    budget = length - NEW_TOKENS
    # each sentence is at least one token; the haystack's draw is its own, so the facts are
    # the same in every haystack
    filler = _filler(budget, haystack, random.Random(f"{task}:{seed}:{haystack}"))

    def build(count: int) -> tuple[str, tuple[tuple[int, int], ...], list[int]]:
        prompt, spans = _assemble(filler[:count], facts, question)
        return prompt, spans, tokenizer(prompt).input_ids

    low, high = 0, budget
    if len(build(0)[2]) > budget:
        raise ValueError(f"lengths: {length} tokens cannot hold a {task} prompt without filler "
                         f"({len(build(0)[2])} tokens) and its {NEW_TOKENS}-token answer")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(build(mid)[2]) <= budget else (low, mid - 1)
    prompt, spans, ids = build(low)
    return Sample(task, length, depth, prompt, list(ids), answer, spans)


def make_samples(tokenizer, task: str, length: int, trials: int, seed: int | str,
                 depths: tuple[float, ...] = DEPTHS, haystack: str = NOISE_HAYSTACK
                 ) -> list[Sample]:
    """``trials`` prompts of ``task`` at ``length`` tokens, the needle at each of ``depths``
    in turn, in ``haystack`` (``NOISE_HAYSTACK`` or a text's name); the same arguments give
    the same prompts (evaluations take integer seeds, the planner's probe a word, so none of
    its prompts is theirs)."""
    return [make_sample(tokenizer, task, length, depths[t % len(depths)], f"{seed}:{length}:{t}",
                        haystack)
            for t in range(trials)]
