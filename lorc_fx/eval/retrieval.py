"""Long-context retrieval, which perplexity cannot see: synthetic tasks generated offline and
seeded, scored by greedy ``generate`` of the full and the compressed model on the same
prompts (``generate`` reads the cache as it decodes, so the scores are decode-time).

- ``passkey``: one five-digit pass key hidden at a depth of filler text;
- ``multikey``: several named pass keys; the one asked sits at the depth, the others
  (distractors) at random depths;
- ``vartrack``: variable tracking over two hops (``VAR A = 12345`` at the depth, ``VAR B = A``
  later, a second chain beside them as distractor); the value of ``B`` is asked.

The filler is the passkey test's noise sentences repeated (``NOISE``), so nothing is read
from disk or network; keys, names and the distractors' depths are drawn per prompt from the
seed. A prompt is sized with the model's tokenizer so that it and its answer fit ``length``
tokens; each trial places the needle at the next of ``depths``.

Nothing tunes on these tasks: the planner never reads their prompts. ``HELD_OUT`` names the
family kept apart for a planner that may one day use the others (with other seeds).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from transformers.cache_utils import DynamicCache

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache import LatentCache, angles_handed
from lorc_fx.cache.layers import PREFILL_TOKENS
from lorc_fx.eval.evaluate import greedy_continuations
from lorc_fx.plan.planner import Plan

TASKS = ("passkey", "multikey", "vartrack")
HELD_OUT = "vartrack"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the needle sits, as a share of the filler
NEW_TOKENS = 8  # generated per prompt: a five-digit answer in any tokenizer, and a margin
MIN_LENGTH = 64
DISTRACTORS = 3  # multikey: keys besides the one asked
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval

HEADER = ("A long text follows. Hidden in it are facts to remember; a question about them "
          "comes at the end.\n\n")
# the haystack of the passkey test (Mohtashami & Jaggi, 2023; RULER's "noise"), repeated: no
# fact in it, nothing a question could be mistaken for
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
         "There and back again.")
_ADJECTIVES = ("red", "blue", "green", "silver", "golden", "black", "white", "amber")
_NOUNS = ("heron", "falcon", "otter", "fox", "badger", "lynx", "raven", "salmon", "wolf",
          "hare")


@dataclass
class Sample:
    """One prompt of a task: its text and ids, the answer, and where the needle sits."""
    task: str
    length: int
    depth: float
    prompt: str
    input_ids: list[int]
    answer: str
    needle_char: int  # where the needle (the asked key, or the chain's first step) begins


def _filler(count: int) -> list[str]:
    return [NOISE[i % len(NOISE)] for i in range(count)]


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
        names = rng.sample([f"{a} {n}" for a in _ADJECTIVES for n in _NOUNS], DISTRACTORS + 1)
        keys = [_number(rng, taken) for _ in names]
        facts = [(depth if i == 0 else rng.random(), f"The pass key of the {name} is {key}.")
                 for i, (name, key) in enumerate(zip(names, keys))]
        return facts, f"What is the pass key of the {names[0]}? The pass key of the " \
                      f"{names[0]} is", keys[0]
    names: list[str] = []
    while len(names) < 4:
        name = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5))
        names += [] if name in names else [name]
    a, b, c, d = names
    value, other = _number(rng, taken), _number(rng, taken)
    second, third = rng.random(), rng.random()
    facts = [(depth, f"VAR {a} = {value}."),
             (depth + (1 - depth) * rng.random(), f"VAR {b} = {a}."),
             (min(second, third), f"VAR {c} = {other}."),
             (max(second, third), f"VAR {d} = {c}.")]
    return facts, f"What is the value of VAR {b}? The value of VAR {b} is", value


def _assemble(filler: list[str], facts: list[tuple[float, str]], question: str
              ) -> tuple[str, int]:
    """The prompt with each fact after ``round(depth * len(filler))`` filler sentences, and
    the character where the first fact begins."""
    slots: dict[int, list[int]] = {}
    for i, (depth, _) in enumerate(facts):
        slots.setdefault(round(depth * len(filler)), []).append(i)
    parts, needle = [HEADER], 0
    for at in range(len(filler) + 1):
        for i in slots.get(at, []):
            if i == 0:
                needle = sum(map(len, parts))
            parts.append(facts[i][1] + " ")
        if at < len(filler):
            parts.append(filler[at] + " ")
    return "".join(parts) + "\n\n" + question, needle


def make_sample(tokenizer, task: str, length: int, depth: float, seed) -> Sample:
    """One prompt of ``task`` whose ids and ``NEW_TOKENS`` answer tokens fit ``length``
    tokens, with as much filler as fits (found by bisection: tokenizers do not add up)."""
    rng = random.Random(f"{task}:{seed}")
    facts, question, answer = _facts(task, depth, rng)
    budget = length - NEW_TOKENS
    filler = _filler(budget)  # each sentence is at least one token

    def build(count: int) -> tuple[str, int, list[int]]:
        prompt, needle = _assemble(filler[:count], facts, question)
        return prompt, needle, tokenizer(prompt).input_ids

    low, high = 0, budget
    if len(build(0)[2]) > budget:
        raise ValueError(f"lengths: {length} tokens cannot hold a {task} prompt without filler "
                         f"({len(build(0)[2])} tokens) and its {NEW_TOKENS}-token answer")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(build(mid)[2]) <= budget else (low, mid - 1)
    prompt, needle, ids = build(low)
    return Sample(task, length, depth, prompt, list(ids), answer, needle)


def make_samples(tokenizer, task: str, length: int, trials: int, seed: int,
                 depths: tuple[float, ...] = DEPTHS) -> list[Sample]:
    """``trials`` prompts of ``task`` at ``length`` tokens, the needle at each of ``depths``
    in turn; the same arguments give the same prompts."""
    return [make_sample(tokenizer, task, length, depths[t % len(depths)], f"{seed}:{length}:{t}")
            for t in range(trials)]


def wilson_interval(correct: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default): unlike the
    normal approximation it stays inside [0, 1] and is not empty at 0 or n successes."""
    if trials == 0:
        return 0.0, 1.0
    p = correct / trials
    shrink = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / shrink
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / shrink
    return (0.0 if correct == 0 else centre - half), (1.0 if correct == trials else centre + half)


@dataclass
class Accuracy:
    correct: int
    trials: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials

    def to_json(self) -> dict:
        low, high = wilson_interval(self.correct, self.trials)
        return {"correct": self.correct, "trials": self.trials, "accuracy": self.accuracy,
                "interval95": [low, high]}

    def __str__(self) -> str:
        low, high = wilson_interval(self.correct, self.trials)
        return f"{self.correct}/{self.trials} [{low:.2f}, {high:.2f}]"


def first_number(output: str) -> str | None:
    """The first number the model wrote, as written; None where it wrote none."""
    found = re.search(r"\d+", output)
    return found.group() if found else None


def is_correct(answer: str, output: str) -> bool:
    """Whether the first number the model wrote is the answer."""
    return first_number(output) == answer


def same_answer(first: str, second: str) -> bool:
    """Whether two outputs give the same answer: the same first number, or none in either."""
    return first_number(first) == first_number(second)


def accuracy(samples: list[Sample], outputs: list[str]) -> Accuracy:
    return Accuracy(sum(is_correct(s.answer, o) for s, o in zip(samples, outputs, strict=True)),
                    len(samples))


def answers(model: nn.Module, tokenizer, samples: list[Sample], compressed: bool) -> list[str]:
    """Greedy answers of the full cache or (``compressed``) the latent cache ``compress``
    installed, a fresh cache per prompt."""
    out = []
    for s in tqdm(samples, desc="compressed" if compressed else "full cache", leave=False):
        ids = torch.tensor([s.input_ids])
        out.append(tokenizer.decode(greedy_continuations(model, [ids], NEW_TOKENS, compressed)[0]))
    return out


class _PrefillTee(DynamicCache):
    """A plain cache whose writes are also written to ``latents`` (each a plan's fresh latent
    cache): one prefill fills them all. The forward is the full model's whatever the plans:
    a latent cache's prefill (a first write of more than ``PREFILL_TOKENS`` tokens) attends
    the tokens it writes as it computed them (``cache.layers._PrefillAsComputed``), so each
    returns what it was given. ``angles_handed`` reaches the ``latents`` through the tee."""

    def __init__(self, config, latents: list[LatentCache]):
        super().__init__(config=config)
        self.latents = latents

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        for latent in self.latents:
            latent.update(key_states, value_states, layer_idx, *args, **kwargs)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


Prefilled = list[tuple[str, object, Plan | None]]  # (name, cache, plan), the full cache first


def _prefilled(model: nn.Module, sample: Sample, plans: dict[str, Plan],
               blocks: list[AttentionBlock]) -> tuple[torch.Tensor, Prefilled]:
    """The last logits of one forward of ``sample``'s prompt, and the caches it wrote: the
    full cache (``"full cache"``, plan ``None``) and each plan's latent cache, by name."""
    if len(sample.input_ids) <= PREFILL_TOKENS:
        raise ValueError(f"one prefill serves every cache only for prompts of more than "
                         f"{PREFILL_TOKENS} tokens (a latent cache reads a shorter one back as "
                         f"stored), not {len(sample.input_ids)}")
    config = model.config.get_text_config(decoder=True)
    ids = torch.tensor([sample.input_ids], device=next(model.parameters()).device)
    tee = _PrefillTee(config, [LatentCache.from_cache(DynamicCache(config=config), p)
                               for p in plans.values()])
    with angles_handed(model, blocks, *plans.values()):
        logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=tee,
                       use_cache=True).logits[:, -1]
    caches = dict(zip(plans, tee.latents))
    tee.latents = []  # the tee decodes on as the full cache
    return logits, [("full cache", tee, None), *((n, caches[n], p) for n, p in plans.items())]


def _step(model: nn.Module, token: torch.Tensor, cache, length: int) -> torch.Tensor:
    """The last logits after ``token`` (``(1, 1)``) is written to ``cache``, which then
    holds ``length`` tokens."""
    mask = torch.ones(1, length, dtype=torch.long, device=token.device)
    return model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]


@torch.no_grad()
def answers_sharing_prefill(model: nn.Module, tokenizer, samples: list[Sample],
                            plans: dict[str, Plan], blocks: list[AttentionBlock]
                            ) -> dict[str, list[str]]:
    """Greedy answers of the full cache (``"full cache"``) and of each plan's latent cache
    (by name) to every prompt, as :func:`answers` gives them, with one prefill a prompt for
    all: the prompt's forward writes every cache (:class:`_PrefillTee`), then each cache
    decodes ``NEW_TOKENS`` greedy tokens on its own (end-of-text suppressed, as
    ``generate``'s ``min_new_tokens``). A long prompt's forward costs far more than the
    steps after it (8k tokens: ~1.5 min of a CPU thread, then a few seconds a plan). Batch
    1, no padding; ``blocks``: the model's attention blocks (``analyze``), whose modules hand
    caches logging RoPE angles their angles."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out: dict[str, list[str]] = {name: [] for name in ["full cache", *plans]}
    for s in tqdm(samples, desc="one prefill, every cache", leave=False):
        logits, caches = _prefilled(model, s, plans, blocks)
        for name, cache, plan in caches:
            with angles_handed(model, blocks, plan):
                new = _greedy_steps(model, logits, cache, len(s.input_ids), eos)
            out[name].append(tokenizer.decode(new))
    return out


@torch.no_grad()
def answer_logprobs_sharing_prefill(model: nn.Module, tokenizer, samples: list[Sample],
                                    plans: dict[str, Plan], blocks: list[AttentionBlock]
                                    ) -> dict[str, list[float]]:
    """The log-probability (nats) of each prompt's answer as its text continues the prompt
    (``" " + answer``), its tokens fed one at a time through the full cache (``"full
    cache"``) and each plan's, one prefill a prompt for all (as
    :func:`answers_sharing_prefill`). A graded score where accuracy is a coin: it moves
    with a cache's errors before they flip an answer, so fewer prompts tell caches apart."""
    out: dict[str, list[float]] = {name: [] for name in ["full cache", *plans]}
    for s in tqdm(samples, desc="one prefill, every cache", leave=False):
        answer = tokenizer(" " + s.answer, add_special_tokens=False).input_ids
        logits, caches = _prefilled(model, s, plans, blocks)
        first = float(logits[0].float().log_softmax(-1)[answer[0]])  # the prefill's: every cache's
        for name, cache, plan in caches:
            total = first
            with angles_handed(model, blocks, plan):
                for i, token in enumerate(answer[:-1]):
                    logits = _step(model, torch.tensor([[token]], device=logits.device), cache,
                                   len(s.input_ids) + i + 1)
                    total += float(logits[0].float().log_softmax(-1)[answer[i + 1]])
            out[name].append(total)
    return out


def _greedy_steps(model: nn.Module, logits: torch.Tensor, cache, prompt: int,
                  eos: list[int]) -> list[int]:
    """``NEW_TOKENS`` greedy tokens after a prompt of ``prompt`` tokens whose last logits are
    ``logits`` and whose keys and values ``cache`` holds."""
    new = []
    for step in range(NEW_TOKENS):
        logits = logits.clone()
        logits[:, eos] = -math.inf
        token = logits.argmax(-1, keepdim=True)
        new.append(int(token))
        if step + 1 < NEW_TOKENS:
            logits = _step(model, token, cache, prompt + step + 1)
    return new


def parse_lengths(listed: str) -> tuple[int, ...]:
    """Comma-separated token counts, ``k`` for 1024 (``1k,2k`` or ``1024,2048``)."""
    try:
        return tuple(int(n[:-1]) * 1024 if n.lower().endswith("k") else int(n)
                     for n in listed.split(","))
    except ValueError:
        raise ValueError(f"lengths must be comma-separated integers (1k = 1024), got "
                         f"{listed!r}") from None


@dataclass
class RetrievalOptions:
    task: str = "passkey"
    lengths: tuple[int, ...] = (1024, 2048)  # tokens of prompt and answer together
    trials: int = 10  # prompts per length
    seed: int = 0

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        lengths = tuple(self.lengths)
        if not lengths or not all(isinstance(n, int) and not isinstance(n, bool)
                                  and n >= MIN_LENGTH for n in lengths):
            raise ValueError(f"lengths must be integers >= {MIN_LENGTH} (up to the model's "
                             f"context limit), got {self.lengths!r}")
        self.lengths = lengths
        for name, least in (("trials", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    def check_fits(self, model: nn.Module) -> None:
        """Refuse a length beyond the model's context limit, naming the range."""
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings",
                        None)
        if limit is not None and max(self.lengths) > limit:
            raise ValueError(f"lengths must be in [{MIN_LENGTH}, {limit}] for this model (its "
                             f"context limit), got {max(self.lengths)}")


@dataclass
class LengthResult:
    """One length of a task: accuracy full and compressed over the same prompts."""
    length: int
    full: Accuracy
    compressed: Accuracy
    prompt_tokens: float  # mean over the prompts
    outputs: list[dict] = field(default_factory=list)  # per prompt: depth, answer, both outputs

    @property
    def same_answers(self) -> int:
        """Prompts the compressed model answered as the full one did, right or wrong: paired,
        so it sees a change that the two accuracies' overlapping intervals hide."""
        return sum(same_answer(o["full"], o["compressed"]) for o in self.outputs)

    def to_json(self) -> dict:
        return {"length": self.length, "prompt_tokens": self.prompt_tokens,
                "full": self.full.to_json(), "compressed": self.compressed.to_json(),
                "same_answers": self.same_answers, "outputs": self.outputs}


def evaluate_retrieval(model: nn.Module, tokenizer, options: RetrievalOptions | None = None
                       ) -> list[LengthResult]:
    """Accuracy of the full and the compressed cache of a model ``compress`` prepared, per
    length, on the same prompts."""
    options = options or RetrievalOptions()
    options.check_fits(model)
    results = []
    for length in options.lengths:
        samples = make_samples(tokenizer, options.task, length, options.trials, options.seed)
        full = answers(model, tokenizer, samples, compressed=False)
        comp = answers(model, tokenizer, samples, compressed=True)
        results.append(LengthResult(
            length, accuracy(samples, full), accuracy(samples, comp),
            sum(len(s.input_ids) for s in samples) / len(samples),
            [{"depth": s.depth, "answer": s.answer, "full": f, "compressed": c}
             for s, f, c in zip(samples, full, comp)]))
    return results
