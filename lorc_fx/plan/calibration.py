"""What the data-aware bases measure on real text, once per model and cached on disk.

One forward pass over calibration windows collects, per attention layer:

- ``input_gram``: ``E[x xᵀ]`` (float64) of the K projection's input. Which module owns the K
  weight comes from the analysis record (the weight's name); a forward pre-hook on it sums
  ``xᵀx``. K and V read the same hidden states in every architecture we know of (one fused
  weight, or two projections of one normed input), so the K owner's input stands for both.
- ``attention``: the layer's attention moments (``lorc_fx.attention_probe``), where the model
  routes attention through transformers' ``AttentionInterface``.

Calibration and evaluation never share text: every ``HOLD_OUT``-th paragraph (0, 4, 8, …) of a
text is reserved for calibration (``data.texts.calibration_part``), and ``lorc_fx.evaluate``
reads only the other paragraphs (``data.texts.evaluation_part``).

The default calibration text is ``"self"``: sequences sampled from the model itself
(:func:`self_generated_windows`, ``lorc_fx.plan.sampling``), so calibration needs no corpus
and no tokenizer, only a token to start from (BOS, EOS, CLS or padding), and it generalises
to genres it never saw better than news and Austen did (bench/calibration_sources.md). Named texts (``"news"``,
``"austen"``, ``"pydoc"``, ``"code"``, ``"poems"``, paths) stay selectable; one this machine
lacks becomes ``"self"`` (:func:`usable_calibration`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .options import SELF_TEXT, CalibrationOptions
from .sampling import SAMPLING, sample_sequences, start_token
from .attention_probe import AttentionMoments, AttentionProbe, attention_modules, probe_supported
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.analysis.sharding import full_tensor
from lorc_fx.data.models import user_cache_dir
from lorc_fx.data.texts import calibration_part

_FORMAT = 1  # bump when what the cache file holds changes
SELF_BATCH = 48  # at most this many sequences sampled side by side
_SEED_STRIDE = 1_000_003  # sequence i of seed s draws from a generator seeded s·stride + i

log = logging.getLogger(__name__)


class CalibrationUnavailable(ValueError):
    """No calibration is possible: the model has no tokenizer, or a text is missing."""


@dataclass
class LayerStatistics:
    input_gram: torch.Tensor  # (D_in, D_in) float64
    attention: AttentionMoments | None


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's config and weights (names, shapes and moments of every tensor).
    Remembered per model until a parameter changes (its version counter moves): a first plan
    asks for it a dozen times, and hashing 135M weights takes a second."""
    versions = tuple(p._version for p in model.parameters())
    known = _FINGERPRINTS.get(model)
    if known is not None and known[0] == versions:
        return known[1]
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = full_tensor(p.detach()).reshape(-1).to(torch.float64)  # TP: whole
            stats = (flat.sum().item(), flat.square().sum().item(), flat[:8].tolist())
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{stats}".encode())
    _FINGERPRINTS[model] = (versions, h.hexdigest()[:16])
    return _FINGERPRINTS[model][1]


_FINGERPRINTS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], str]]" = \
    weakref.WeakKeyDictionary()


def calibration_windows(tokenizer, options: CalibrationOptions,
                        model: nn.Module | None = None) -> torch.Tensor:
    """``(n, window)`` token ids: non-overlapping windows drawn at random from the
    calibration paragraphs of each text, the same number from each. The text ``"self"`` is
    sampled from ``model`` (:func:`self_generated_windows`; ``tokenizer`` may then be
    ``None``)."""
    from lorc_fx.data.texts import TextNotFoundError, load_text

    per_text = -(-options.tokens // (options.window * len(options.texts)))
    gen = torch.Generator().manual_seed(options.seed)
    out = []
    for name in options.texts:
        if name == SELF_TEXT:
            if model is None:
                raise CalibrationUnavailable(f"calibration text {SELF_TEXT!r} needs the model")
            out += list(self_generated_windows(model, tokenizer, per_text, options.window,
                                               options.seed))
            continue
        if tokenizer is None:
            raise CalibrationUnavailable(f"calibration text {name!r} needs the model's tokenizer")
        try:
            text = load_text(name)
        except TextNotFoundError as err:
            raise CalibrationUnavailable(str(err)) from err
        ids = tokenizer(calibration_part(text), return_tensors="pt").input_ids[0]
        available = len(ids) // options.window
        if available < per_text:
            raise ValueError(f"the calibration part of {name!r} holds {len(ids)} tokens, fewer "
                             f"than {per_text} windows of {options.window}")
        starts = torch.randperm(available, generator=gen)[:per_text].sort().values * options.window
        out += [ids[s:s + options.window] for s in starts.tolist()]
    return torch.stack(out)


def owner_module(weight_name: str) -> str:
    """The name of the module that holds the weight ``weight_name``."""
    return weight_name.rsplit(".", 1)[0]


def collect(model: nn.Module, blocks: list[AttentionBlock], windows: torch.Tensor,
            batch_size: int = 2,
            backward: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> dict:
    """Input grams per K-owning module and attention moments per layer, over ``windows``;
    with ``backward``, each batch's forward runs with gradients and ``backward(batch,
    logits)`` is called after it (``plan.sensitivity`` measures the loss's gradients in the
    same pass)."""
    supported = [b for b in blocks if b.supported]
    modules = sorted({owner_module(b.k.weight) for b in supported})
    sums: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(modules, 0)

    def hook_for(name):
        def hook(module, args, kwargs):
            x = (args[0] if args else next(iter(kwargs.values()))).detach()
            x = x.reshape(-1, x.shape[-1]).to(torch.float64)
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] += x.shape[0]
        return hook

    handles = [model.get_submodule(m).register_forward_pre_hook(hook_for(m), with_kwargs=True)
               for m in modules]
    layers = attention_modules(model, {b.layer: b.k.weight for b in supported})
    device = next(model.parameters()).device
    probe = AttentionProbe(model, layers)
    from tqdm.auto import tqdm

    desc = "calibrating on it" + (" (and the loss's gradients)" if backward else "")
    try:
        with probe if probe_supported(model) else contextlib.nullcontext():
            for batch in tqdm(windows.split(batch_size), desc=desc, unit="batch",
                              mininterval=1.0):
                batch = batch.to(device)
                with torch.set_grad_enabled(backward is not None):
                    logits = model(batch, use_cache=False).logits
                    if backward is not None:
                        backward(batch, logits)
    finally:
        for h in handles:
            h.remove()
    attention = {layer: asdict(m) for layer, m in probe.moments().items()}
    return {"input_grams": {m: (sums[m] / counts[m]).cpu() for m in sums},
            "attention": attention}


def model_tokenizer(model: nn.Module):
    """The tokenizer saved with the model (``name_or_path``)."""
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as err:
        raise CalibrationUnavailable(
            f"calibration needs the model's tokenizer, and none loads from {source!r}: "
            f"load the model from a directory that holds one, or calibrate on "
            f"{SELF_TEXT!r} (text sampled from the model itself)") from err


def calibration_tokenizer(model: nn.Module, options: CalibrationOptions):
    """The model's tokenizer; ``None`` where it has none and ``"self"`` is the only text
    (sampled token ids need no tokenizer)."""
    try:
        return model_tokenizer(model)
    except CalibrationUnavailable:
        if set(options.texts) == {SELF_TEXT}:
            return None
        raise


def sampling_key(options: CalibrationOptions) -> dict:
    """What else the text of ``options`` depends on, for cache keys: how ``"self"`` is
    sampled, where it is read."""
    return {"self_sampling": SAMPLING} if SELF_TEXT in options.texts else {}


def cache_path(model: nn.Module, blocks: list[AttentionBlock], options: CalibrationOptions) -> Path:
    return calibration_file("", {"format": _FORMAT, "model": model_fingerprint(model),
                                 "k_weights": [b.k.weight for b in blocks if b.supported],
                                 **asdict(options), **sampling_key(options)})


def calibration_file(kind: str, key: dict, suffix: str = ".pt") -> Path:
    """Where what was measured under ``key`` is kept: the cache directory's ``calibration/``,
    the file named by ``kind`` (a prefix: ``"self-"``, ``"split-"``, ...) and a hash of the
    key as sorted JSON."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return user_cache_dir() / "calibration" / f"{kind}{digest[:20]}{suffix}"


def measure_statistics(model: nn.Module, blocks: list[AttentionBlock],
                       options: CalibrationOptions, tokenizer=None,
                       backward: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                       ) -> dict:
    """:func:`collect` on the windows of ``options`` (``backward`` as it takes it), written
    where :func:`layer_statistics` reads them."""
    windows = calibration_windows(tokenizer or calibration_tokenizer(model, options), options,
                                  model)
    data = collect(model, blocks, windows, backward=backward)
    save_atomic(data, cache_path(model, blocks, options))
    return data


def layer_statistics(model: nn.Module, blocks: list[AttentionBlock],
                     options: CalibrationOptions | None = None,
                     tokenizer=None) -> dict[int, LayerStatistics]:
    """Per supported layer: its input gram and attention moments, from the disk cache when
    this model was calibrated with these options before."""
    options = options or CalibrationOptions()
    path = cache_path(model, blocks, options)
    data = (torch.load(path, weights_only=True) if path.is_file()
            else measure_statistics(model, blocks, options, tokenizer))
    out = {}
    for b in blocks:
        if b.supported:
            moments = data["attention"].get(b.layer)
            out[b.layer] = LayerStatistics(data["input_grams"][owner_module(b.k.weight)],
                                           AttentionMoments(**moments) if moments else None)
    return out


def save_atomic(obj, path: Path, write=torch.save) -> None:
    """``write(obj, file)`` to a temporary file and rename, so an interrupted run leaves no
    partial cache (``write``: ``torch.save``, or ``write_json`` for a JSON file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(obj, file) -> None:
    """``obj`` written to ``file`` as JSON (a ``write`` of :func:`save_atomic`)."""
    Path(file).write_text(json.dumps(obj, indent=1))


# --- the self-generated calibration text ---------------------------------------------------

def self_cache_path(model: nn.Module, start: int, window: int, seed: int) -> Path:
    """Where the sequences of ``seed`` sampled from ``model`` are kept."""
    return calibration_file("self-", {"model": model_fingerprint(model), "seed": seed,
                                      "window": window, "start": start, **SAMPLING})


def can_read(model: nn.Module, options: CalibrationOptions) -> bool:
    """Whether the text ``options`` name can be had for ``model``: named texts are checked
    by :func:`usable_calibration`; the model's own needs a token to start from (``sampling.start_token``)."""
    return SELF_TEXT not in options.texts or \
        start_token(model, calibration_tokenizer(model, options)) is not None


def sampled_before(model: nn.Module, options: CalibrationOptions) -> bool:
    """Whether every sequence ``options`` read from the model itself is on disk already
    (true where they read none, or nothing can be sampled)."""
    request = self_text_request(options)
    if request is None:
        return True
    count, window, seed = request
    start = start_token(model, calibration_tokenizer(model, options))
    if start is None:
        return True
    path = self_cache_path(model, start, window, seed)
    return path.is_file() and len(torch.load(path, weights_only=True)) >= count


def self_generated_windows(model: nn.Module, tokenizer, count: int, window: int,
                           seed: int = 0) -> torch.Tensor:
    """``(count, window)`` token ids sampled from ``model`` itself (``lorc_fx.plan.sampling``),
    each from the same first token (``sampling.start_token``: BOS, else EOS, ...).

    Sequence ``i`` of ``seed`` draws from its own generator, so the first ``n`` sequences do
    not depend on how many are asked for or how they are batched: sequences are kept on disk
    per model, seed and window (``calibration/self-*.pt`` in the cache directory) and only
    the missing ones are sampled (:func:`sample_self_text`)."""
    return sample_self_text(model, tokenizer, [(count, window, seed)])[0]


def self_text_request(options: CalibrationOptions) -> tuple[int, int, int] | None:
    """``(count, window, seed)`` of the sampled sequences ``options`` read, if any."""
    if SELF_TEXT not in options.texts:
        return None
    return -(-options.tokens // (options.window * len(options.texts))), options.window, options.seed


def sample_self_text(model: nn.Module, tokenizer,
                     requests: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The sequences of each ``(count, window, seed)`` request (:func:`self_generated_windows`).
    Every sequence not on disk yet is sampled in one pass (batches of up to ``SELF_BATCH``
    sequences side by side), under one progress bar, after one warning that says where the
    samples are kept; asking for the calibration and the held-out sequences together
    costs little more than the calibration alone."""
    start = start_token(model, tokenizer)
    if start is None:
        raise CalibrationUnavailable(
            f"calibration text {SELF_TEXT!r} samples from a BOS, EOS, CLS or padding token, "
            f"and neither the tokenizer nor the config of {type(model).__name__} names one")
    stored: dict[Path, torch.Tensor] = {}
    wanted: dict[Path, tuple[int, int, int]] = {}
    paths = [self_cache_path(model, start, window, seed) for _, window, seed in requests]
    for (count, window, seed), path in zip(requests, paths):
        if path not in stored:
            stored[path] = (torch.load(path, weights_only=True) if path.is_file()
                            else torch.empty(0, window, dtype=torch.long))
        wanted[path] = (max(count, wanted.get(path, (0,))[0]), window, seed)
    todo = {path: range(len(stored[path]), count) for path, (count, _, _) in wanted.items()
            if len(stored[path]) < count}
    if todo:
        from tqdm.auto import tqdm

        first = next(iter(todo))
        log.info("calibration: sampling %d sequences of text from the model itself, once "
                 "per model (kept in %s)", sum(map(len, todo.values())), first.parent)
        total = sum(len(todo[p]) * (wanted[p][1] - 1) for p in todo)
        with tqdm(total=total, unit="tok", desc="sampling calibration text",
                  mininterval=1.0) as bar:
            for window in sorted({wanted[p][1] for p in todo}):
                jobs = [(p, wanted[p][2] * _SEED_STRIDE + i) for p in todo
                        if wanted[p][1] == window for i in todo[p]]
                batches = -(-len(jobs) // SELF_BATCH)
                size = -(-len(jobs) // batches)  # even batches: 36 sequences are one batch
                for b in range(0, len(jobs), size):
                    batch = jobs[b:b + size]
                    rows = sample_sequences(model, start, window, [s for _, s in batch],
                                            bar.update)
                    for (path, _), row in zip(batch, rows):
                        stored[path] = torch.cat([stored[path], row[None]])
        for path in todo:
            save_atomic(stored[path], path)
    return [stored[path][:count] for (count, _, _), path in zip(requests, paths)]


def usable_calibration(model: nn.Module, options: CalibrationOptions) -> CalibrationOptions:
    """``options`` with every named text this machine lacks (or that needs a tokenizer the
    model does not have) replaced by the model's own samples (``"self"``), with a warning;
    the options themselves where every text is at hand."""
    from lorc_fx.data.texts import TextNotFoundError, load_text

    named = [t for t in options.texts if t != SELF_TEXT]
    missing, reasons = [], []
    if named:
        try:
            model_tokenizer(model)
        except CalibrationUnavailable as err:
            missing, reasons = named, [str(err)]
        else:
            for name in named:
                try:
                    load_text(name)
                except TextNotFoundError as err:
                    missing.append(name)
                    reasons.append(str(err))
    if not missing:
        return options
    texts = tuple(t for t in options.texts if t not in missing)
    texts = texts if SELF_TEXT in texts else texts + (SELF_TEXT,)
    log.warning("calibration text(s) %s unavailable (%s); calibrating on %s instead",
                ", ".join(map(repr, missing)), "; ".join(reasons), "+".join(texts))
    return replace(options, texts=texts)
