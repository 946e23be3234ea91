"""Quality of a compressed model on real text, through the real compressed path.

- perplexity, full cache vs latent cache, **decoded** as ``generate`` reads the cache: each
  window's first ``decode_after`` in one forward through a fresh latent cache, then every
  other token one at a time, both scored on the tokens after the prompt (the prompt's
  forward attends its own tokens as it computed them, as a prefill does: its predictions
  are the full model's). ``decode_after=None``: the whole window in one forward, every
  token read back as stored (``prefill_as_stored``), which a cache that keeps its newest
  tokens in full precision, or codes them only in blocks, reads otherwise than decoding
  does: such figures are labelled **one forward**. The full cache is exact either way and
  is scored in one forward;
- next-token agreement: how often the compressed model's argmax equals the full model's;
- next-token KL divergence KL(full ‖ compressed), per token in nats, from both models'
  log-softmax in float64: perplexity alone can stay flat (or even improve) while the
  distribution, and so the model's answers, move;
- greedy generation from fixed prompts, uncompressed vs compressed: the share of generated
  tokens that agree position by position, and how many continuations agree entirely;
- cache bytes per token and bits per cached K/V value, from the plan and measured on the
  latent cache's tensors.

Windows come only from the evaluation part of a text (``data.texts.evaluation_part``), so
evaluation never reads a paragraph calibration read. They are ``window`` tokens long, evenly
spaced over that part.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.cache_probe import fresh_cache
from lorc_fx.data.texts import HOLD_OUT, evaluation_part, split_paragraphs
from lorc_fx.cache import latent_cache

PROMPT_TOKENS = 24


DECODE_AFTER = 64  # tokens of each window read in one forward before the rest is decoded


@dataclass
class EvalOptions:
    text: str = "news"
    tokens: int = 8192  # evaluated tokens in all, in windows of ``window``
    window: int = 512
    # tokens of each window read in one forward (at most half the window) before the rest is
    # decoded one at a time; None: the whole window in one forward (one-forward scoring)
    decode_after: int | None = DECODE_AFTER
    prompts: int = 4  # greedy-generation prompts, taken from the evaluation text
    new_tokens: int = 32
    # windows a forward: decoding a token a step reads every weight once per batch, so 4 windows
    # decode in about half the time of 2 (the default model, int8 cache, one thread: 33.6 s
    # against 65.6 s for 8 windows of 192 tokens, 128 decoded); their logits are 4 × window ×
    # vocabulary floats (400 MB for the default model's 512 × 49152)
    batch_size: int = 4
    compile: bool = False  # score compiled: full cache by Inductor, latent cache by lorc_backend

    def __post_init__(self):
        for name, least in (("window", 2), ("tokens", self.window), ("prompts", 0),
                            ("new_tokens", 1), ("batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        p = self.decode_after
        if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < 1):
            raise ValueError(f"decode_after must be an integer >= 1, or None (one-forward "
                             f"scoring), got {p!r}")

    @property
    def prompt(self) -> int | None:
        """Tokens of each window read in one forward before decoding (None: all of them)."""
        return None if self.decode_after is None else min(self.decode_after, self.window // 2)

    @property
    def scoring(self) -> str:
        """How the compressed model's windows were read, in words."""
        return ("one forward per window" if self.prompt is None else
                f"decoded: {self.prompt} tokens in one forward, the rest one at a time and scored")


@dataclass
class EvalResult:
    ppl_full: float
    ppl_compressed: float
    top1_agreement: float  # next-token argmax, compressed vs full, over the windows
    kl_mean: float  # mean next-token KL(full ‖ compressed) over the same positions, nats
    generation: dict
    cache_bytes_per_token_measured: float
    bits_per_value_measured: float = 0.0  # from the latent cache's tensors, floats at 16 bits
    seconds: dict = field(default_factory=dict)
    scoring: str = ""  # how the compressed windows were read (``EvalOptions.scoring``)

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_compressed / self.ppl_full


def evaluation_windows(tokenizer, text: str, tokens: int, window: int) -> torch.Tensor:
    """``(tokens // window, window)`` ids evenly spaced over the evaluation part of ``text``."""
    ids = tokenizer(evaluation_part(text), return_tensors="pt").input_ids[0]
    count = max(1, tokens // window)
    if len(ids) < count * window:
        raise ValueError(f"its evaluation part (3 of every {HOLD_OUT} paragraphs; the others "
                         f"are calibration's) holds {len(ids)} tokens, fewer than {count} "
                         f"windows of {window}; ask for fewer tokens or give a longer text")
    step = (len(ids) - window) // max(1, count - 1) if count > 1 else 0
    return torch.stack([ids[i * step:i * step + window] for i in range(count)])


def prompts_from(tokenizer, text: str, count: int) -> list[torch.Tensor]:
    """The first ``PROMPT_TOKENS`` tokens of ``count`` evenly spaced evaluation paragraphs;
    a text with fewer paragraphs that long is refused rather than prompted less."""
    if count == 0:
        return []
    paragraphs = [p for p in split_paragraphs(evaluation_part(text))
                  if len(tokenizer(p).input_ids) >= PROMPT_TOKENS]
    if len(paragraphs) < count:
        raise ValueError(f"prompts: {count} asked, but only {len(paragraphs)} evaluation "
                         f"paragraphs of the text hold {PROMPT_TOKENS} tokens; ask for fewer "
                         "prompts or give a longer text")
    picked = paragraphs[:: max(1, len(paragraphs) // count)][:count]
    return [tokenizer(p, return_tensors="pt").input_ids[:, :PROMPT_TOKENS] for p in picked]


@dataclass
class WindowScores:
    ppl: float
    cache_bytes_per_token: float  # measured on the latent cache; 0 for the full cache
    bits_per_value: float = 0.0  # measured on the latent cache (LatentCache.bits_per_value)
    top1_agreement: float | None = None  # with a reference: share of argmaxes equal to its
    kl_mean: float | None = None  # with a reference: mean KL(reference ‖ model) per token, nats


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ model) of every position's next-token distribution, in nats, from the
    log-softmax of both in float64 (float32 loses the small divergences of a good plan)."""
    ref, got = reference_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1)


def decoded_logits(model: nn.Module, ids: torch.Tensor, cache, prompt: int | None,
                   after_step: Callable[[], None] | None = None) -> torch.Tensor:
    """The logits of ``ids`` read through ``cache`` as ``generate`` reads it: the first
    ``prompt`` tokens in one forward, then one token a step (``None``: all in one forward);
    ``after_step`` is called after each one-token step (to read the cache as it stands)."""
    if prompt is None:
        return model(ids, past_key_values=cache, use_cache=True).logits
    out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        if after_step is not None:
            after_step()
    return torch.cat(out, dim=1)


@torch.no_grad()
def score_windows(model: nn.Module, windows: torch.Tensor, compressed: bool,
                  batch_size: int = 2, reference: nn.Module | None = None,
                  prompt: int | None = None, progress: str | None = None) -> WindowScores:
    """Perplexity over ``windows``, through the plain forward or (``compressed``) a fresh
    latent cache per batch, each window's first ``prompt`` tokens in one forward and the rest
    decoded one at a time (``decoded_logits``; ``None``: one forward, read back as stored),
    scored on the tokens after the first ``prompt`` (every token but the first with ``None``;
    the uncompressed model's the same with the same ``prompt``). With ``reference`` (a
    runner of the uncompressed model: its plain forward), every batch also runs through it,
    for next-token argmax agreement and KL divergence from it over the same positions.
    ``progress``: a progress bar of that name over the tokens read (decoding a window a
    token a step takes minutes on a CPU)."""
    device = next(model.parameters()).device
    total, count, cache_bytes, same, kl = 0.0, 0, 0, 0, 0.0
    cache_bits = cached_values = 0
    first = 0 if prompt is None else prompt - 1  # the first logit scored
    bar = tqdm(total=windows.numel(), desc=progress, unit="tok", disable=progress is None,
               leave=False)
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        read = bar.n
        if compressed:
            cache = latent_cache(model, prefill_as_stored=prompt is None)
            logits = decoded_logits(model, batch, cache, prompt,
                                    after_step=lambda: bar.update(len(batch)))
            cache_bytes += cache.cache_bytes()
            cache_bits += cache.cache_bits()
            cached_values += cache.cached_values()
        else:
            logits = model(batch, use_cache=False).logits
        bar.update(batch.numel() - (bar.n - read))  # the tokens read in one forward
        logits, targets = logits[:, first:-1].float(), batch[:, first + 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
        count += targets.numel()
        if reference is not None:
            full = reference(batch, use_cache=False).logits[:, first:-1]
            same += int((logits.argmax(-1) == full.argmax(-1)).sum())
            kl += sum(float(next_token_kl(f, c).sum()) for f, c in zip(full, logits))  # a window
            # at a time: float64 log-probs of a 512-token window of a 49k vocabulary are 200 MB
    bar.close()
    compared = {} if reference is None else {"top1_agreement": same / count, "kl_mean": kl / count}
    return WindowScores(math.exp(total / count),
                        cache_bytes / windows.numel() if compressed else 0.0,
                        cache_bits / cached_values if cached_values else 0.0, **compared)


@torch.no_grad()
def greedy_continuations(model: nn.Module, prompts: list[torch.Tensor], new_tokens: int,
                         compressed: bool) -> list[list[int]]:
    """Greedy continuations; a fresh plain cache (``fresh_cache``) keeps a compressed model's
    generate on the full cache."""
    device = next(model.parameters()).device
    out = []
    for ids in prompts:
        kwargs = {} if compressed else {"past_key_values": fresh_cache(model)}
        seq = model.generate(ids.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **kwargs)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def agreement(full: list[list[int]], compressed: list[list[int]]) -> dict:
    """How greedy continuations agree; ``None`` for every figure where none was generated."""
    if not full:
        return {"token_agreement": None, "exact_match": None, "mean_common_prefix": None}
    same = sum(a == b for f, c in zip(full, compressed) for a, b in zip(f, c))
    prefixes = [next((i for i, (a, b) in enumerate(zip(f, c)) if a != b), len(f))
                for f, c in zip(full, compressed)]
    return {"token_agreement": same / sum(len(f) for f in full),
            "exact_match": sum(f == c for f, c in zip(full, compressed)) / len(full),
            "mean_common_prefix": sum(prefixes) / len(prefixes)}


def evaluation_inputs(tokenizer, text: str, options: EvalOptions
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The perplexity windows and generation prompts ``options`` ask of ``text``; a text
    too short for them is refused, naming it (check before loading a model)."""
    try:
        return (evaluation_windows(tokenizer, text, options.tokens, options.window),
                prompts_from(tokenizer, text, options.prompts))
    except ValueError as err:
        raise ValueError(f"text {options.text!r}: {err}") from None


def evaluate(model: nn.Module, tokenizer, text: str, options: EvalOptions | None = None) -> EvalResult:
    """Perplexity, next-token agreement and KL, and greedy agreement of a model prepared by
    ``lorc_fx.compress`` (its uncompressed path is the plain forward / a plain cache), on the
    text ``text``. Agreement and KL compare with the eager plain forward, run beside the
    compressed one batch by batch (full-vocabulary logits of every window are too large to
    keep)."""
    options = options or EvalOptions()
    windows, prompts = evaluation_inputs(tokenizer, text, options)
    full_runner = comp_runner = model
    if options.compile:  # the full cache under Inductor, the latent cache under lorc_backend
        from lorc_fx.compile.backend import lorc_backend
        torch._dynamo.reset()
        full_runner = torch.compile(model)
        comp_runner = torch.compile(model, backend=lorc_backend)
    seconds = {}
    start = time.perf_counter()
    full_scores = score_windows(full_runner, windows, False, options.batch_size,
                                prompt=options.prompt, progress="perplexity, full cache")
    seconds["ppl_full"] = time.perf_counter() - start
    if options.compile:
        torch._dynamo.reset()
    start = time.perf_counter()  # the reference is the eager plain forward, also when compiled
    scores = score_windows(comp_runner, windows, True, options.batch_size, reference=model,
                           prompt=options.prompt, progress="perplexity, compressed cache"
                           + ("" if options.prompt is None else ", decoded"))
    seconds["ppl_compressed_and_kl"] = time.perf_counter() - start

    start = time.perf_counter()
    full = greedy_continuations(model, prompts, options.new_tokens, compressed=False)
    comp = greedy_continuations(model, prompts, options.new_tokens, compressed=True)
    seconds["generation"] = time.perf_counter() - start
    generation = {
        **agreement(full, comp), "new_tokens": options.new_tokens,
        "samples": [{"prompt": tokenizer.decode(p[0]), "full": tokenizer.decode(f),
                     "compressed": tokenizer.decode(c)} for p, f, c in zip(prompts, full, comp)]}
    return EvalResult(full_scores.ppl, scores.ppl, scores.top1_agreement, scores.kl_mean,
                      generation, scores.cache_bytes_per_token, scores.bits_per_value, seconds,
                      options.scoring)
