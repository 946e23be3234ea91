"""Long-context retrieval, which perplexity cannot see: the synthetic tasks of
``lorc_fx.data.retrieval_tasks`` (passkey, multikey, relay, vartrack; generated offline and
seeded) scored by greedy ``generate`` of the full and the compressed model on the same
prompts (``generate`` reads the cache as it decodes, so the scores are decode-time).

Nothing tunes on the evaluation's prompts: the planner's retrieval probe
(``search.retrieval_probe``) reads multikey prompts of its own seed, and ``HELD_OUT``
(vartrack) is the family it never reads, kept to report.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.data.retrieval_tasks import (MIN_LENGTH, NEW_TOKENS, NOISE_HAYSTACK, TASKS, Sample,
                                          make_samples)
from lorc_fx.data.texts import TEXT_NAMES, is_text
from lorc_fx.eval.evaluate import greedy_continuations
from lorc_fx.plan.planner import Plan
from lorc_fx.search.one_prefill import FULL, side_by_side, step

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


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


@torch.no_grad()
def answers_sharing_prefill(model: nn.Module, tokenizer, samples: list[Sample],
                            plans: dict[str, Plan], blocks: list[AttentionBlock],
                            peers: dict[str, Callable[[], Cache]] | None = None
                            ) -> dict[str, list[str]]:
    """Greedy answers of the full cache (``"full cache"``), of each plan's latent cache and of
    each of ``peers``' caches (a fresh one by name, e.g. transformers' ``QuantizedCache``) to
    every prompt, as ``generate`` gives them, with one prefill a prompt for
    all: the prompt's forward writes every cache (``search.one_prefill``), then every cache
    decodes ``NEW_TOKENS`` greedy tokens, side by side in one forward a step, each row its own
    cache (end-of-text suppressed, as ``generate``'s ``min_new_tokens``). A long prompt's
    forward costs far more than the steps after it (8k tokens: ~1.5 min of a CPU thread,
    then a few seconds a plan). One prompt at a time, no padding; ``blocks``: the model's
    attention blocks (``analyze``), whose modules hand caches logging RoPE angles their
    angles."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out: dict[str, list[str]] = {name: [] for name in [FULL, *plans, *(peers or {})]}
    for s in tqdm(samples, desc="one prefill, every cache", leave=False):
        # one prompt's caches at a time: they are freed before the next prompt's prefill
        for name, row in zip(out, _greedy_sharing_prefill(model, s, plans, blocks, eos, peers),
                             strict=True):
            out[name].append(tokenizer.decode(row))
    return out


def _greedy_sharing_prefill(model: nn.Module, sample: Sample, plans: dict[str, Plan],
                            blocks: list[AttentionBlock], eos: list[int],
                            peers: dict[str, Callable[[], Cache]] | None) -> list[list[int]]:
    """The greedy tokens of the full cache, then of each plan's and each peer's, after one
    prefill."""
    with side_by_side(model, sample.input_ids, plans, blocks, peers) as (logits, cache):
        return _greedy_steps(model, logits, cache, len(sample.input_ids), eos).tolist()


def _greedy_steps(model: nn.Module, logits: torch.Tensor, cache, prompt: int,
                  eos: list[int]) -> torch.Tensor:
    """``(b, NEW_TOKENS)`` greedy tokens after a prompt of ``prompt`` tokens whose last logits
    are ``logits`` ``(b, vocab)`` and whose keys and values ``cache`` holds (each row's its
    own: ``SideBySide``)."""
    new = []
    for i in range(NEW_TOKENS):
        logits = logits.clone()
        logits[:, eos] = -math.inf
        new.append(logits.argmax(-1, keepdim=True))
        if i + 1 < NEW_TOKENS:
            logits = step(model, new[-1], cache, prompt + i + 1)[:, -1]
    return torch.cat(new, dim=1)


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
    haystack: str = NOISE_HAYSTACK  # the filler: noise sentences repeated, or a text's

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.haystack != NOISE_HAYSTACK and not is_text(self.haystack):
            raise ValueError(f"haystack must be {NOISE_HAYSTACK!r}, a known text "
                             f"({', '.join(TEXT_NAMES)}) or a text file, got {self.haystack!r}")
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
        samples = make_samples(tokenizer, options.task, length, options.trials, options.seed,
                               haystack=options.haystack)
        full = answers(model, tokenizer, samples, compressed=False)
        comp = answers(model, tokenizer, samples, compressed=True)
        results.append(LengthResult(
            length, accuracy(samples, full), accuracy(samples, comp),
            sum(len(s.input_ids) for s in samples) / len(samples),
            [{"depth": s.depth, "answer": s.answer, "full": f, "compressed": c}
             for s, f, c in zip(samples, full, comp)]))
    return results
