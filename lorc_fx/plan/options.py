"""What a user can ask of the plan, declared once and checked where it enters.

:class:`PlanOptions` is the one declaration of the plan's options: ``plan``, ``compress`` and
``lorc_backend`` take one, or keyword overrides of its defaults; each field carries its help
text and its check (:func:`option`), so the ``lorc`` command line generates its flags from the
fields and every refusal names the option and its valid range. ``__post_init__`` runs every
check once, before any model is touched. "auto" fields are what the search chooses
(``lorc_fx.search``); a plan records its options with them resolved.

:class:`Budget` is the size asked, in the one unit the user gave (bits per value or cache
fraction), converted once.

A leaf module: the names of the schedules and bases are listed here, and their registries
(``schedules.SCHEDULES``, ``allocation``, ``bases.BASES``) are checked against these lists
by the tests, so options can be validated without importing the machinery behind them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable

AUTO = "auto"
ROPE_MODES = ("commute", "reconstruct")
SCHEDULE_NAMES = ("progressive", "uniform", "greedy", "calibrated")
BASIS_NAMES = ("auto", "weight", "norm", "whitened", "attention")
# what rope="auto" optimises: the held-out loss, or decode speed (keys in a RoPE-commuting
# basis, which decode scores without rebuilding them; keys cached before RoPE in the basis that
# fits them best are rebuilt over the whole context every step, which costs about what full
# attention does: bench/results/long_context_lowrank-cpu.md)
OBJECTIVES = ("quality", "speed")
LATENT_BITS = (16, 8, 4)  # 16: latents kept in the model's dtype (not quantized)
LATENT_GROUPS = (32, 64)  # group sizes the bit-width search tries (the first: the default)
MIN_BITS_PER_VALUE = 0.5  # below it no plan of 4-bit latents keeps a usable rank
STORED_FLOAT_BITS = 16  # what a stored float counts in bits per value (dtype-independent)
# quantization scales and zero points are stored in 16 bits whatever the model's dtype (its
# own where it has 16 bits, else float16: ``planner.scale_dtype``), as a 16-bit deployment
# and KIVI store them, so a float32 model measures what one would
SCALE_BITS = 16
DEFAULT_FRACTION = 0.6  # the budget where none is given
BUDGET_FIELDS = ("cache_fraction", "bits_per_value", "max_ppl_increase")  # one says the budget
# vector codes: how much more the channels of the layers retrieval leans on weigh in the bit
# allocation (``search.retrieval_probe``); chosen on multikey prompts of one seed, judged on
# others (docs/retrieval.md)
RETRIEVAL_WEIGHT = 16.0
# vector codes: the retrieval answers' sensitivities (``search.answer_sensitivity``) added to
# the channels' weights at this many times the text's total, or at a half or a quarter of it,
# the largest within ``schemes.vector.RETRIEVAL_COST``: on the default model's 1.92-bit plans
# of five calibration seeds, ×1 / ×2 / ×4 kept 64% / 78% / 80% of the full cache's held-out
# vartrack answers at 8k against 52% (docs/retrieval.md)
ANSWER_WEIGHT = 4.0
MAX_PPL_INCREASE = 10.0  # a target above ×11 perplexity is a typo, not a quality target
# the calibration text sampled from the model itself (``calibration.self_generated_windows``)
SELF_TEXT = "self"
# cache positions a vector plan's drift offset covers (``cache.stores.drift``): chunks of 1024
# found every relay answer at 8k the codes alone lost, at 0.014 bits per value (docs/retrieval.md)
DRIFT_CHUNK = 1024
# the fewest: a dynamic store's spare code slots (two blocks of 8) fit in the chunk past its
# tokens, which attention over the codes relies on (``cache.stores.drift``)
MIN_DRIFT_CHUNK = 16
# a vector plan's cache keeps the most recent 1/256 of its tokens in full precision: on
# multikey prompts of a seed no evaluation uses, the last 1/256 read exact gave back 3 of the
# 1.92-bit plan's 8 lost answers at 4k and lost none, at about 0.05 bits per value
# (docs/retrieval.md, bench/retrieval_positions.py)
RECENT_DIVISOR = 256


def option(default, help: str, check: Callable | None = None, parse: Callable | None = None,
           flag: str | None = None, **kwargs):
    """A dataclass field with what the command line and the checks need: ``help`` (the flag's
    text), ``check`` (value → an error message, or ``None`` where it is valid), ``parse``
    (the flag's text → value; default ``type(default)``), ``flag`` (the flag's name where it
    is not the field's). ``help=""`` keeps the field off the command line."""
    return field(default=default, metadata={"help": help, "check": check, "parse": parse,
                                            "flag": flag}, **kwargs)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _in_range(name: str, lo: float, hi: float, lo_open: bool = False, note: str = ""):
    """A check that a number lies in ``[lo, hi]`` (``(lo, hi]`` where ``lo_open``); ``None``
    passes (the field not given)."""
    bracket = "(" if lo_open else "["

    def check(x):
        if x is None:
            return None
        if not _number(x) or not (lo < x if lo_open else lo <= x) or not x <= hi:
            return f"{name} must be a number in {bracket}{lo:g}, {hi:g}]{note}, got {x!r}"
        return None
    return check


def _at_least(name: str, least: int):
    return lambda x: (None if _integer(x) and x >= least
                      else f"{name} must be an integer >= {least}, got {x!r}")


def _number_at_least(name: str, least: float):
    return lambda x: (None if _number(x) and x >= least
                      else f"{name} must be a number >= {least:g}, got {x!r}")


def _one_of(what: str, choices: tuple):
    return lambda x: None if x in choices else f"unknown {what} {x!r}; choose from {list(choices)}"


def _texts(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


@dataclass(frozen=True)
class CalibrationOptions:
    """``tokens`` tokens in windows of ``window``, split evenly over ``texts``: names for
    ``lorc_fx.data.texts.load_text``, whose windows are drawn at random (``seed``) from their
    calibration paragraphs, or ``"self"``, sequences sampled from the model itself (``seed``
    picks them), which needs no corpus and no tokenizer."""

    # 32 sampled sequences of 256 tokens: as good on every genre measured as 16384 tokens in
    # windows of 512, at half the sampling and calibration time (bench/calibration_sources.md)
    texts: tuple[str, ...] = option(
        (SELF_TEXT,), "comma-separated texts the data-aware bases calibrate on: self (text "
        "sampled from the model itself, cached), news, austen, pydoc, code, poems, or paths, of "
        "which only every 4th paragraph is read; a missing text becomes self",
        lambda t: None if t else "calibration needs at least one text", _texts, "text")
    tokens: int = option(8192, "calibration tokens, in windows of --calibration-window",
                         _at_least("calibration tokens", 1))
    seed: int = option(0, "seed of the calibration windows drawn (or sampled)",
                       lambda x: None if _integer(x) else f"calibration seed must be an "
                                                          f"integer, got {x!r}")
    window: int = option(256, "tokens per calibration window (per sampled sequence for self)",
                         _at_least("calibration window", 2))

    def __post_init__(self):
        if isinstance(self.texts, str):
            object.__setattr__(self, "texts", (self.texts,))
        _check(self)


@dataclass(frozen=True)
class Budget:
    """The cache's size as asked: ``value`` bits per cached K/V value (``in_bits``; every
    stored float counted at ``STORED_FLOAT_BITS`` whatever the model's dtype, so 16 is an
    uncompressed 16-bit cache), or a fraction of the uncompressed cache's bytes in the
    model's own dtype. Every comparison of a plan with what was asked goes through here."""

    value: float
    in_bits: bool

    @property
    def unit(self) -> str:
        return "bits per value" if self.in_bits else "cache fraction"

    @property
    def top(self) -> float:
        """The whole cache in this unit."""
        return float(STORED_FLOAT_BITS) if self.in_bits else 1.0

    @property
    def whole(self) -> bool:
        """The budget of the whole cache (every latent dim kept, the identity plan)."""
        return self.value >= self.top

    def bits(self, dtype_bits: int) -> tuple[float, int]:
        """(bits per full K/V value the cache may hold, bits a stored float counts), for a
        model whose floats have ``dtype_bits`` bits."""
        if self.in_bits:
            return float(self.value), STORED_FLOAT_BITS
        return self.value * dtype_bits, dtype_bits

    def of_bits(self, bits: float, dtype_bits: int) -> float:
        """``bits`` per value (floats counted as :meth:`bits` counts them) in this unit."""
        return bits if self.in_bits else bits / dtype_bits

    def of(self, plan) -> float:
        """``plan``'s size in this unit."""
        return plan.bits_per_value if self.in_bits else plan.cache_fraction

    def __str__(self) -> str:
        return (f"bits_per_value {self.value:g}" if self.in_bits
                else f"cache fraction {self.value:.3f}")

    def asked(self) -> str:
        """The request in words, for reports."""
        return (f"{self.value:g} bits per value" if self.in_bits
                else f"cache fraction {self.value:.4f}")


def _latent_bits(text: str) -> int | str:
    """``--latent-bits``: an integer or ``auto`` (the range is checked with the options)."""
    try:
        return text if text == AUTO else int(text)
    except ValueError:
        raise ValueError(f"--latent-bits must be 16, 8, 4 or auto, got {text!r}") from None


@dataclass(frozen=True)
class PlanOptions:
    """Every option of a plan (the fields' metadata say each one's meaning and range; the
    first fields in the order positional arguments have always taken them). The budget is
    one of ``cache_fraction`` (default 0.6), ``bits_per_value`` or ``max_ppl_increase``."""

    cache_fraction: float | None = option(
        None, "kept K+V cache bytes / full K+V cache bytes in the model's dtype, in (0, 1]; "
        f"default {DEFAULT_FRACTION}, or what --max-ppl-increase or --bits-per-value says",
        _in_range("cache_fraction", 0, 1, lo_open=True), float)
    schedule: str = option(
        "calibrated", "how ranks are spread over layers: calibrated (key/value split measured "
        "on calibration text) | greedy | progressive (the paper) | uniform",
        _one_of("schedule", SCHEDULE_NAMES))
    rope: str = option(
        AUTO, "auto (both modes where the model hands attention its RoPE angles, the better on "
        "calibration text) | reconstruct (cache keys before RoPE, plus the angles) | commute "
        "(cache keys after it)", _one_of("rope mode", (AUTO, *ROPE_MODES)))
    basis: str = option(
        "auto", "auto (attention-aware, calibrated; weight only where the model has no "
        "BOS/EOS token to sample from) | attention | whitened | norm | weight (the paper)",
        _one_of("basis", BASIS_NAMES))
    skip_threshold: float | None = option(
        None, "layers whose cumulative condition number exceeds this stay full",
        lambda x: None if x is None or (_number(x) and x >= 0)
        else f"skip_threshold must be a non-negative number, got {x!r}", float)
    keep_first: int = option(0, "the first N layers stay full", _at_least("keep_first", 0))
    rank_multiple: int = option(8, "every kept rank is a multiple of this (or the full width)",
                                _at_least("rank_multiple", 1))
    key_fraction: float | None = option(
        None, "calibrated schedule: keys' kept ratio in [0, 1]; default: measured",
        _in_range("key_fraction", 0, 1), float)
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    allow_zero_rank: bool = option(  # let a compressed side keep no latent dim at all
        False, "", lambda x: None if isinstance(x, bool)
        else f"allow_zero_rank must be True or False, got {x!r}")
    objective: str = option(
        "quality", "what --rope auto optimises: quality (held-out loss) | speed (keys in a "
        "RoPE-commuting basis, cached before RoPE where the model hands attention its angles, "
        "else after it: decode scores them without rebuilding them; the quality objective's "
        "reconstruct rebuilds them every step, so decodes slower at long context)",
        _one_of("objective", OBJECTIVES))
    retrieval_weight: float = option(
        RETRIEVAL_WEIGHT, "vector codes: how many times more the latent channels of the layers "
        "retrieval leans on weigh in the bit allocation (those whose codes alone move the "
        "answers of multikey prompts most, measured by the planner), or its square root "
        "where that costs more than 0.02 nats of held-out loss, or none where both do; "
        ">= 1, 1: no layer favoured and no probe run",
        _number_at_least("retrieval_weight", 1), float)
    answer_weight: float = option(
        ANSWER_WEIGHT, "vector codes: the answers of retrieval prompts (multikey prompts of the "
        "planner's own, their loss's sensitivity to each latent channel) weigh in the bit "
        "allocation beside the text's, at this many times the text's total, else at half or "
        "a quarter of it, the largest whose plan costs at most 0.02 nats of held-out loss more "
        "than the text's weights alone with no layer favoured for retrieval (the cap the "
        "favoured layers share), or not at all; >= 0, 0: not measured",
        _number_at_least("answer_weight", 0), float)
    codebook_tails: bool = option(
        False, "vector codes: the 4- to 6-bit scalar tables keep levels past the range of the "
        "calibration latents, so keys that drift past it in a long, repetitive context are "
        "not clipped; with --calibration-window 1024 --calibration-tokens 32768 it keeps "
        "retrieval at 8k tokens (docs/retrieval.md), for more loss on short text",
        lambda x: None if isinstance(x, bool)
        else f"codebook_tails must be True or False, got {x!r}")
    drift_chunk: int = option(
        DRIFT_CHUNK, "vector codes: each chunk of this many cache positions is coded about its "
        "mean latent's drift from the first chunk's, measured at the prefill (one row of "
        "offsets a chunk, counted in the budget), so a long context's keys are not clipped "
        "where they drift past the calibration latents; 0: no offsets",
        lambda x: None if isinstance(x, int) and not isinstance(x, bool)
        and (x == 0 or x >= MIN_DRIFT_CHUNK)
        else f"drift_chunk must be 0 or a whole number >= {MIN_DRIFT_CHUNK}, got {x!r}", int)
    recent_divisor: int = option(
        RECENT_DIVISOR, "vector codes: a cache of n tokens keeps its most recent ceil(n / this) "
        "in full precision (counted in the budget), the tokens a decode step's question and "
        "answer lean on; 0: only the partial block of 8",
        lambda x: None if isinstance(x, int) and not isinstance(x, bool) and x >= 0
        else f"recent_divisor must be a whole number >= 0, got {x!r}", int)
    # latents stored as latent_bits-bit codes, per channel over groups of latent_group tokens;
    # 16: not quantized; auto: the storage scheme and its width measured (``lorc_fx.search``)
    latent_bits: int | str = option(
        AUTO, "auto: measure plain 8- and 4-bit KV quantization, then keys water-filled over "
        "8/4/3-bit latent rows beside plain 4-bit values, vector codes below 4.5 bits per "
        "value, then 16-, 8- and 4-bit latents at the rank that fills the budget, and keep the "
        "least held-out loss (a plain candidate within 0.002 nats of the full cache ends the "
        "search); 16, 8 or 4: low-rank latents stored that way (per channel over groups of "
        "--latent-group tokens). With --basis weight or norm (no calibration) auto is 16 "
        "unless the budget is --bits-per-value",
        lambda x: None if x == AUTO or (_integer(x) and x in LATENT_BITS)
        else f"latent_bits must be one of {[*LATENT_BITS, AUTO]}, got {x!r}", _latent_bits)
    latent_group: int | None = option(
        None, f"tokens per quantization group of a latent channel; default: {LATENT_GROUPS[0]}, "
        f"and with --latent-bits auto both {' and '.join(map(str, LATENT_GROUPS))} are measured",
        lambda x: None if x is None or (_integer(x) and x >= 1)
        else f"latent_group must be a positive integer (even for latent_bits=4: two codes per "
             f"byte), got {x!r}", int)
    bits_per_value: float | None = option(
        None, "instead of --cache-fraction: the budget in bits per cached K/V value, in "
        f"[{MIN_BITS_PER_VALUE:g}, 16], every stored float counted at 16 bits (16: an "
        "uncompressed 16-bit cache)",
        _in_range("bits_per_value", MIN_BITS_PER_VALUE, 16,
                  note=" (16: an uncompressed 16-bit cache)"), float)
    # bases block-diagonal over this many equal groups of KV heads, the same rank in each:
    # the tensor-parallel split, where each process caches the latents of its own heads
    shards: int | None = option(
        None, "bases block-diagonal over this many equal groups of KV heads, the same rank in "
        "each (what a tensor-parallel model is cached by); default: the model's "
        "tensor-parallel split (--tp), else 1",
        lambda x: None if x is None or (_integer(x) and x >= 1)
        else f"shards must be an integer >= 1, got {x!r}", int)
    max_ppl_increase: float | None = option(
        None, "instead of --cache-fraction: the smallest fraction (steps of 0.05) whose "
        "perplexity on held-out calibration text is at most 1 + this times the full cache's, "
        "e.g. 0.02 (a plan per fraction tried)",
        _in_range("max_ppl_increase", 0, MAX_PPL_INCREASE, lo_open=True,
                  note=" (0.02: at most 2% more perplexity)"), float)

    def __post_init__(self):
        _check(self)
        given = [n for n in BUDGET_FIELDS if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give {' or '.join(given)}, not both (got "
                             + ", ".join(f"{n}={getattr(self, n)!r}" for n in given)
                             + "): each says the cache's budget")
        widths = LATENT_BITS if self.latent_bits == AUTO else (self.latent_bits,)
        if self.latent_group is not None and any((self.latent_group * b) % 8 for b in widths):
            raise ValueError(f"latent_group must be a positive integer (even for latent_bits=4: "
                             f"two codes per byte), got {self.latent_group!r}")
        if (self.shards or 1) > 1 and self.basis == "attention":
            raise ValueError("basis='attention' has no per-shard form yet (shards > 1, a "
                             "tensor-parallel model); use basis='whitened', 'norm' or 'weight'")
        if (self.shards or 1) > 1 and self.rope == "reconstruct":
            raise ValueError("rope='reconstruct' has no per-shard form yet (shards > 1): each "
                             "process would keep its own RoPE angle log; use rope='commute'")

    @classmethod
    def of(cls, options: "PlanOptions | None" = None, **overrides) -> "PlanOptions":
        """``options`` (default: the defaults) with ``overrides``, checked once; a budget
        among the overrides replaces the one ``options`` say."""
        if options is None:
            return cls(**overrides)
        if not overrides:
            return options
        if any(k in overrides for k in BUDGET_FIELDS):
            overrides = {**{k: None for k in BUDGET_FIELDS}, **overrides}
        return replace(options, **overrides)

    @property
    def rope_commuting_keys(self) -> bool:
        """Whether key bases commute with RoPE: keys cached after it (``commute``), and under
        ``objective="speed"`` keys cached before it too, so that decode scores them per rotary
        pair instead of rebuilding them (``compile.latent_attention.per_frequency_scores``)."""
        return self.rope == "commute" or self.objective == "speed"

    @property
    def budget(self) -> Budget:
        if self.bits_per_value is not None:
            return Budget(self.bits_per_value, in_bits=True)
        return Budget(DEFAULT_FRACTION if self.cache_fraction is None else self.cache_fraction,
                      in_bits=False)

    def concrete(self) -> "PlanOptions":
        """The options with every "auto" the rank planner cannot take at its first choice:
        ``rope`` commute, ``latent_bits`` 16, ``latent_group`` 32, ``shards`` 1 (what a plan
        records where nothing chose otherwise)."""
        return replace(self, rope=ROPE_MODES[0] if self.rope == AUTO else self.rope,
                       latent_bits=16 if self.latent_bits == AUTO else self.latent_bits,
                       latent_group=LATENT_GROUPS[0] if self.latent_group is None
                       else self.latent_group,
                       shards=1 if self.shards is None else self.shards)

    def latent_bits_per_value(self, float_bits: int) -> float:
        """Bits per cached latent value where an unquantized float has ``float_bits`` bits:
        the code, plus a 16-bit scale and zero point (``SCALE_BITS``) shared by
        ``latent_group`` tokens of one channel; ``float_bits`` unquantized."""
        o = self.concrete()
        if o.latent_bits == 16:
            return float(float_bits)
        return o.latent_bits + 2 * SCALE_BITS / o.latent_group


def _check(options) -> None:
    """Run every field's check (:func:`option`); the first failure raises a ``ValueError``
    naming the field and its range."""
    for f in fields(options):
        check = f.metadata.get("check")
        message = check(getattr(options, f.name)) if check else None
        if message:
            raise ValueError(message)
