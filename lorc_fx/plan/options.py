"""What a user can ask of the plan, checked where it enters.

A leaf module: the names of the schedules and bases are listed here, and their registries
(``schedules.SCHEDULES``, ``allocation``, ``bases.BASES``) are checked against these lists
by the tests, so options can be validated without importing the machinery behind them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROPE_MODES = ("commute", "reconstruct")
SCHEDULE_NAMES = ("progressive", "uniform", "greedy", "calibrated")
BASIS_NAMES = ("auto", "weight", "norm", "whitened", "attention")
# what rope="auto" optimises: the held-out loss, or decode speed (keys cached after RoPE are
# read by absorbed attention; keys cached before it are rebuilt over the whole context every
# step, which costs about what full attention does: bench/results/long_context_lowrank-cpu.md)
OBJECTIVES = ("quality", "speed")
LATENT_BITS = (16, 8, 4)  # 16: latents kept in the model's dtype (not quantized)
LATENT_GROUPS = (32, 64)  # group sizes the bit-width search tries (the first: the default)
MIN_BITS_PER_VALUE = 0.5  # below it no plan of 4-bit latents keeps a usable rank
STORED_FLOAT_BITS = 16  # what a stored float counts in bits per value (dtype-independent)
# quantization scales and zero points are stored in 16 bits whatever the model's dtype (its
# own where it has 16 bits, else float16: ``cache.latent_cache.scale_dtype``), as a 16-bit
# deployment and KIVI store them, so a float32 model measures what one would
SCALE_BITS = 16
# the calibration text sampled from the model itself (``calibration.self_generated_windows``)
SELF_TEXT = "self"


@dataclass(frozen=True)
class CalibrationOptions:
    """``tokens`` tokens in windows of ``window``, split evenly over ``texts``: names for
    ``lorc_fx.data.texts.load_text``, whose windows are drawn at random (``seed``) from their
    calibration paragraphs, or ``"self"``, sequences sampled from the model itself (``seed``
    picks them), which needs no corpus and no tokenizer."""

    # 32 sampled sequences of 256 tokens: as good on every genre measured as 16384 tokens in
    # windows of 512, at half the sampling and calibration time (bench/calibration_sources.md)
    texts: tuple[str, ...] = (SELF_TEXT,)
    tokens: int = 8192
    seed: int = 0
    window: int = 256

    def __post_init__(self):
        if isinstance(self.texts, str):
            object.__setattr__(self, "texts", (self.texts,))
        if not self.texts:
            raise ValueError("calibration needs at least one text")
        if self.tokens < 1 or self.window < 2:
            raise ValueError(f"calibration tokens must be >= 1 and window >= 2, got "
                             f"{self.tokens}, {self.window}")


@dataclass(frozen=True)
class PlanOptions:
    cache_fraction: float = 0.6
    schedule: str = "calibrated"
    rope: str = "commute"
    basis: str = "auto"
    skip_threshold: float | None = None  # layers with cumulative κ̃ above it stay full
    keep_first: int = 0  # the first N layers stay full
    rank_multiple: int = 8
    key_fraction: float | None = None  # calibrated schedule: keys' kept ratio (None: measured)
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    allow_zero_rank: bool = False  # let a compressed side keep no latent dim at all
    objective: str = "quality"  # what rope="auto" optimises (OBJECTIVES)
    # latents stored as latent_bits-bit codes, per channel over groups of latent_group tokens
    # (one scale and zero point per channel and group, in the model's dtype); 16: not quantized
    latent_bits: int = 16
    latent_group: int = 32
    # the budget in bits per cached K/V value, every stored float (unquantized latents, raw
    # sides, scales, zero points, the RoPE angle log) counted at 16 bits: dtype-independent,
    # 16 = an uncompressed 16-bit cache. None: the budget is ``cache_fraction`` (bytes against
    # the uncompressed cache in the model's own dtype)
    bits_per_value: float | None = None
    # bases block-diagonal over this many equal groups of KV heads, the same rank in each:
    # the tensor-parallel split, where each process caches the latents of its own heads
    shards: int = 1

    def __post_init__(self):
        f = self.cache_fraction
        if not _is_number(f) or not 0 < f <= 1:
            raise ValueError(f"cache_fraction must be a number in (0, 1], got {f!r}")
        b = self.bits_per_value
        if b is not None and (not _is_number(b) or not MIN_BITS_PER_VALUE <= b <= 16):
            raise ValueError(f"bits_per_value must be a number in [{MIN_BITS_PER_VALUE}, 16] "
                             f"(16: an uncompressed 16-bit cache), got {b!r}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {sorted(SCHEDULE_NAMES)}")
        if self.basis not in BASIS_NAMES:
            raise ValueError(f"unknown basis {self.basis!r}; choose from {sorted(BASIS_NAMES)}")
        if self.rope not in ROPE_MODES:
            raise ValueError(f"unknown rope mode {self.rope!r}; choose from {list(ROPE_MODES)}")
        if self.skip_threshold is not None and not (_is_number(self.skip_threshold)
                                                    and self.skip_threshold >= 0):
            raise ValueError(f"skip_threshold must be a non-negative number, got {self.skip_threshold!r}")
        if not _is_int(self.keep_first) or self.keep_first < 0:
            raise ValueError(f"keep_first must be an integer >= 0, got {self.keep_first!r}")
        if not _is_int(self.rank_multiple) or self.rank_multiple < 1:
            raise ValueError(f"rank_multiple must be an integer >= 1, got {self.rank_multiple!r}")
        if self.key_fraction is not None and not (_is_number(self.key_fraction)
                                                  and 0 <= self.key_fraction <= 1):
            raise ValueError(f"key_fraction must be a number in [0, 1], got {self.key_fraction!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose from {list(OBJECTIVES)}")
        if not isinstance(self.allow_zero_rank, bool):
            raise ValueError(f"allow_zero_rank must be True or False, got {self.allow_zero_rank!r}")
        if not _is_int(self.latent_bits) or self.latent_bits not in LATENT_BITS:
            raise ValueError(f"latent_bits must be one of {list(LATENT_BITS)}, got {self.latent_bits!r}")
        if not _is_int(self.latent_group) or self.latent_group < 1 or \
                (self.latent_group * self.latent_bits) % 8:
            raise ValueError(f"latent_group must be a positive integer (even for latent_bits=4: "
                             f"two codes per byte), got {self.latent_group!r}")
        if not _is_int(self.shards) or self.shards < 1:
            raise ValueError(f"shards must be an integer >= 1, got {self.shards!r}")
        if self.shards > 1 and self.basis == "attention":
            raise ValueError("basis='attention' has no per-shard form yet (shards > 1, a "
                             "tensor-parallel model); use basis='whitened', 'norm' or 'weight'")

    def latent_bytes_per_value(self, dtype_bytes: int) -> float:
        """Bytes per cached latent value, everything counted, for a model whose dtype has
        ``dtype_bytes`` bytes: the code, plus a 16-bit scale and zero point (``SCALE_BITS``)
        shared by ``latent_group`` tokens of one channel; ``dtype_bytes`` unquantized."""
        return self.latent_bits_per_value(8 * dtype_bytes) / 8

    def latent_bits_per_value(self, float_bits: int) -> float:
        """Bits per cached latent value where an unquantized float has ``float_bits`` bits."""
        if self.latent_bits == 16:
            return float(float_bits)
        return self.latent_bits + 2 * SCALE_BITS / self.latent_group

    def budget(self, dtype_bits: int) -> tuple[float, int]:
        """(bits per full K/V value the cache may hold, bits a stored float counts): from
        ``bits_per_value`` (floats at 16 bits), else ``cache_fraction`` of the model's dtype."""
        if self.bits_per_value is not None:
            return float(self.bits_per_value), STORED_FLOAT_BITS
        return self.cache_fraction * dtype_bits, dtype_bits

    @property
    def unchanged(self) -> bool:
        """The budget of the whole cache (every latent dim kept, the identity plan)."""
        if self.bits_per_value is not None:
            return self.bits_per_value >= STORED_FLOAT_BITS
        return self.cache_fraction >= 1.0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
