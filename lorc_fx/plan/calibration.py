"""What the data-aware bases measure on real text, once per model and cached on disk.

One forward pass over calibration windows collects, per attention layer:

- ``input_gram``: ``E[x xᵀ]`` (float64) of the K projection's input. Which module owns the K
  weight comes from the analysis record (the weight's name); a forward pre-hook on it sums
  ``xᵀx``. K and V read the same hidden states in every architecture we know of (one fused
  weight, or two projections of one normed input), so the K owner's input stands for both.
- ``attention``: the layer's attention moments (``lorc_fx.attention_probe``), where the model
  routes attention through transformers' ``AttentionInterface``.

Calibration and evaluation never share text: every ``HOLD_OUT``-th paragraph (0, 4, 8, …) of a
text is reserved for calibration (:func:`calibration_part`), and ``lorc_fx.evaluate`` reads
only the other paragraphs (:func:`evaluation_part`). The default calibration mixes the news
articles and the Austen novels that ship with this project, so no network is needed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .options import CalibrationOptions
from .attention_probe import AttentionMoments, AttentionProbe, attention_modules, probe_supported
from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.data.models import user_cache_dir
from lorc_fx.data.texts import split_paragraphs

HOLD_OUT = 4
_FORMAT = 1  # bump when what the cache file holds changes


class CalibrationUnavailable(ValueError):
    """No calibration is possible: the model has no tokenizer, or a text is missing."""


@dataclass
class LayerStatistics:
    input_gram: torch.Tensor  # (D_in, D_in) float64
    attention: AttentionMoments | None


def calibration_part(text: str) -> str:
    """The paragraphs reserved for calibration: every ``HOLD_OUT``-th, from the first."""
    return "\n\n".join(p for i, p in enumerate(split_paragraphs(text)) if i % HOLD_OUT == 0)


def evaluation_part(text: str) -> str:
    """Every paragraph calibration never reads."""
    return "\n\n".join(p for i, p in enumerate(split_paragraphs(text)) if i % HOLD_OUT != 0)


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's config and weights (names, shapes and moments of every tensor)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1).to(torch.float64)
            stats = (flat.sum().item(), flat.square().sum().item(), flat[:8].tolist())
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{stats}".encode())
    return h.hexdigest()[:16]


def calibration_windows(tokenizer, options: CalibrationOptions) -> torch.Tensor:
    """``(n, window)`` token ids: non-overlapping windows drawn at random from the
    calibration paragraphs of each text, the same number from each."""
    from lorc_fx.data.texts import TextNotFoundError, load_text

    per_text = -(-options.tokens // (options.window * len(options.texts)))
    gen = torch.Generator().manual_seed(options.seed)
    out = []
    for name in options.texts:
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


def _owner(weight_name: str) -> str:
    return weight_name.rsplit(".", 1)[0]


@torch.no_grad()
def collect(model: nn.Module, blocks: list[AttentionBlock], windows: torch.Tensor,
            batch_size: int = 2) -> dict:
    """Input grams per K-owning module and attention moments per layer, over ``windows``."""
    supported = [b for b in blocks if b.supported]
    modules = sorted({_owner(b.k.weight) for b in supported})
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
    try:
        with probe if probe_supported(model) else contextlib.nullcontext():
            for batch in windows.split(batch_size):
                model(batch.to(device), use_cache=False)
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
            f"load the model from a directory that holds one, or use basis='weight'") from err


def cache_path(model: nn.Module, blocks: list[AttentionBlock], options: CalibrationOptions) -> Path:
    key = json.dumps({"format": _FORMAT, "model": model_fingerprint(model),
                      "k_weights": [b.k.weight for b in blocks if b.supported], **asdict(options)},
                     sort_keys=True)
    return user_cache_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.pt"


def layer_statistics(model: nn.Module, blocks: list[AttentionBlock],
                     options: CalibrationOptions | None = None,
                     tokenizer=None) -> dict[int, LayerStatistics]:
    """Per supported layer: its input gram and attention moments, from the disk cache when
    this model was calibrated with these options before."""
    options = options or CalibrationOptions()
    path = cache_path(model, blocks, options)
    if path.is_file():
        data = torch.load(path, weights_only=True)
    else:
        windows = calibration_windows(tokenizer or model_tokenizer(model), options)
        data = collect(model, blocks, windows)
        _save_atomic(data, path)
    out = {}
    for b in blocks:
        if b.supported:
            moments = data["attention"].get(b.layer)
            out[b.layer] = LayerStatistics(data["input_grams"][_owner(b.k.weight)],
                                           AttentionMoments(**moments) if moments else None)
    return out


def _save_atomic(obj, path: Path) -> None:
    """Write to a temporary file and rename, so an interrupted run leaves no partial cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
