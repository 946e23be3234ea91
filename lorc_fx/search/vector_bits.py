"""The vector candidate: product vector codes fitted on calibration latents, bits allocated
per tuple of channels (``plan.vector_allocation``), the keys' share of the bits measured.

The calibration windows run once through the latent cache of the full-rank plan (keys before
RoPE); every layer's cached latents, less each window's first token (the sink, never coded),
are the samples. Per side and per width of ``WIDTHS`` a book is fitted on them
(``cache.vector_codes.fit``: k-means per sub-vector, reconstructions keeping each channel's
variance) and its relative squared error per channel measured on the same samples; the
allocation cuts each layer's book from those (``select``). A channel's relative error is
weighed by the spectra's energies or by what the loss minds it (``plan.sensitivity``:
diagonal Fisher times the channel's power, measured on the same windows, where a side's
latent is linear in its projection); which weights, and which share of the bits the keys
get (``KEY_SHARES``), are chosen together by the held-out calibration loss.

Why these constants (bench/results/bit_waterfill-cpu.md, fake-quantized on news, Austen and
poems with the share chosen on the planner's held-out windows): tuples of 16 channels and
half-bit widths gave the least loss at 2.56 and 1.92 bits per value. The shares bracket the
best found under either weighting (0.35-0.45 under the energies, 0.40-0.45 under the
sensitivities at 1.92-3 bits, in the run behind bench/results/bits_pareto-cpu.md, which
logs each at INFO); the sensitivities had the lower held-out loss there, by 0.002-0.007
nats, small enough that the energies stay a candidate.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
from dataclasses import replace

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.cache.vector_codes import VectorBook, VectorSpec, decode, encode, fit, select
from lorc_fx.data.models import user_cache_dir
from lorc_fx.plan.calibration import (calibration_tokenizer, calibration_windows,
                                      model_fingerprint, sampling_key, save_atomic)
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import (LayerInput, LayerPlan, Plan, key_energies, plan_layers,
                                  value_energies)
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.plan.sensitivity import Side, latent_sensitivities
from lorc_fx.plan.vector_allocation import code_budget, vector_bits
from lorc_fx.search.split import held_out_loss
from lorc_fx.search.windows import through_cache

WIDTHS = (0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6)  # bits a channel a book is fitted at
TUPLE_DIMS = 16  # channels allocated one width together (the longest sub-vector)
KEY_SHARES = (0.3, 0.35, 0.4, 0.45)  # keys' share of the codes' bits, measured
FIT_ITERATIONS = 15  # Lloyd iterations per book

_FORMAT = 3  # bump when what fitted_books computes changes (2: the coding errors kept too;
# 3: the bases kept too, compared on reading)
BASES_ATOL = 1e-6  # bases this close to those the books were fitted under reuse them: the same
# calibration at another thread count moved the default model's by at most 4e-12

Books = dict[Side, dict[float, VectorBook]]

log = logging.getLogger(__name__)


def _coded_sides(plan: Plan) -> list[Side]:
    return [(l.layer, side) for l in plan.layers if not l.skipped
            for side, ok in (("k", l.k_compressible), ("v", l.v_compressible)) if ok]


@torch.no_grad()
def calibration_latents(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                        windows: torch.Tensor) -> dict[Side, torch.Tensor]:
    """Per coded side of ``full`` (a full-rank, unquantized plan), its cached latents on
    ``windows`` as ``(samples, r)`` float32, each window's first token left out."""
    samples: dict[Side, list[torch.Tensor]] = {}
    for _, _, cache in through_cache(model, blocks, full, windows):
        for layer, side in _coded_sides(full):
            latent = getattr(cache.layers[layer], "keys" if side == "k" else "values")
            samples.setdefault((layer, side), []).append(
                latent[:, 0, 1:].reshape(-1, latent.shape[-1]).float().cpu())
    return {key: torch.cat(parts) for key, parts in samples.items()}


def fit_books(samples: dict[Side, torch.Tensor], widths: tuple[float, ...] = WIDTHS,
              tuple_dims: int = TUPLE_DIMS, iters: int = FIT_ITERATIONS
              ) -> Books:
    """Per side, a book of its whole latent at each width (shows progress: minutes)."""
    books: Books = {}
    with tqdm(total=len(samples) * len(widths), desc="lorc: fitting vector codebooks",
              unit="book") as bar:
        for key, x in samples.items():
            books[key] = {}
            for b in widths:
                books[key][b] = fit(x, VectorSpec(((x.shape[1], b),), tuple_dims), iters=iters)
                bar.update()
    return books


def _bases(full: Plan) -> dict[str, torch.Tensor]:
    """The basis of every coded side of ``full``, by ``"layer/side"``."""
    layers = {l.layer: l for l in full.layers}
    return {f"{layer}/{side}": getattr(layers[layer], f"{side}_basis")
            for layer, side in _coded_sides(full)}


def _books_file(model: nn.Module, full: Plan):
    """Where the books of ``model`` fitted on the latents of ``full`` are cached: keyed by the
    model and the calibration text (the bases they were fitted under are kept in the file and
    compared on reading: their bytes vary with the thread count)."""
    key = json.dumps({"format": _FORMAT, "model": model_fingerprint(model),
                      "calibration": repr(full.options.calibration),
                      **sampling_key(full.options.calibration), "basis": full.options.basis,
                      "rope": full.options.rope, "widths": WIDTHS, "tuple_dims": TUPLE_DIMS,
                      "iters": FIT_ITERATIONS}, sort_keys=True)
    return user_cache_dir() / "calibration" / f"vector-{hashlib.sha256(key.encode()).hexdigest()[:20]}.pt"


def _fitted_under(data: dict, bases: dict[str, torch.Tensor]) -> bool:
    """Whether cached books were fitted under ``bases`` (to ``BASES_ATOL``)."""
    kept = data.get("bases", {})
    return all(name in kept and kept[name].shape == basis.shape
               and torch.allclose(kept[name].double(), basis.double(), rtol=0, atol=BASES_ATOL)
               for name, basis in bases.items())


def _read_books(data: dict, full: Plan) -> tuple[Books, dict[Side, dict[float, torch.Tensor]]]:
    """The books and coding errors of every coded side of ``full`` in a books file's ``data``."""
    books, rho = {}, {}
    for layer, side in _coded_sides(full):
        books[layer, side], rho[layer, side] = {}, {}
        for b in WIDTHS:
            codewords, values = data["books"][f"{layer}/{side}/{b}"]
            width = codewords.shape[0] * codewords.shape[2]  # sub-vectors × channels each
            books[layer, side][b] = VectorBook(VectorSpec(((width, b),), TUPLE_DIMS),
                                               ((codewords, values),))
            rho[layer, side][b] = data["errors"][f"{layer}/{side}/{b}"]
    return books, rho


def fitted_books(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                 windows: torch.Tensor) -> tuple[Books, dict[Side, dict[float, torch.Tensor]]]:
    """The books fitted on the latents of ``full`` on ``windows`` and their coding errors
    there (:func:`fit_books`, :func:`coding_errors`), from the disk cache where these were
    fitted before under the same bases (``BASES_ATOL``): a later plan neither runs the
    windows nor measures again (else fitted, ~20 min on 2 cores for the default model, and
    written there, said once)."""
    path, bases = _books_file(model, full), _bases(full)
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if _fitted_under(data, bases):
            return _read_books(data, full)
        log.warning("vector codes: the calibrated bases are not those the cached codebooks in "
                    "%s were fitted under; fitting them again", path)
    samples = calibration_latents(model, blocks, full, windows)
    log.warning("vector codes: fitting codebooks for every coded side at %d widths on %d "
                "calibration latents each (once per model: they are cached in %s)",
                len(WIDTHS), next(iter(samples.values())).shape[0], path.parent)
    books = fit_books(samples)
    rho = coding_errors(samples, books)
    save_atomic({"books": {f"{layer}/{side}/{b}": list(book.tables[0])
                           for (layer, side), by_width in books.items()
                           for b, book in by_width.items()},
                 "errors": {f"{layer}/{side}/{b}": err for (layer, side), by_width in rho.items()
                            for b, err in by_width.items()},
                 "bases": bases}, path)
    return books, rho


def coding_errors(samples: dict[Side, torch.Tensor], books: Books
                  ) -> dict[Side, dict[float, torch.Tensor]]:
    """Per side and width, each channel's squared coding error over its squared values."""
    out = {}
    for key, x in samples.items():
        power = (x.double() ** 2).sum(0).clamp_min(1e-30)
        out[key] = {b: ((decode(encode(x[None], book), book)[0] - x).double() ** 2).sum(0) / power
                    for b, book in books[key].items()}
    return out


def _coded(layer: LayerPlan, side: str, bits: list[float], books: dict[float, VectorBook],
           energy: torch.Tensor, tuple_dims: int) -> LayerPlan:
    """``layer`` keeping the channels of ``side`` with nonzero ``bits``, coded by the book cut
    from ``books`` (``energy``: the channels' spectrum energies)."""
    basis, rebuild = getattr(layer, f"{side}_basis"), getattr(layer, f"{side}_rebuild")
    if any(bits):
        book, kept = select(books, bits, tuple_dims)
    else:
        book, kept = None, torch.zeros(0, dtype=torch.long)
    total = float(energy.sum())
    return replace(layer, **{f"{side}_rank": len(kept), f"{side}_basis": basis[kept],
                             f"{side}_rebuild": rebuild[kept], f"{side}_book": book,
                             f"{side}_energy_kept": float(energy[kept].sum()) / total
                             if total > 0 else 1.0})


def vector_plan(full: Plan, inputs: list[LayerInput], options: PlanOptions,
                books: Books,
                rho: dict[Side, dict[float, torch.Tensor]], key_share: float,
                weights: dict[Side, torch.Tensor] | None = None,
                tuple_dims: int = TUPLE_DIMS) -> Plan:
    """The vector plan at ``options``' budget from ``full`` (full rank, its basis rows in the
    order of the energies of ``inputs``) with ``books`` and their errors ``rho``, each
    channel's relative error weighed by ``weights`` (``plan.sensitivity``; ``None``: the
    spectra's energies)."""
    sides = _coded_sides(full)
    keys = [s for s in sides if s[1] == "k"]
    values = [s for s in sides if s[1] == "v"]
    if not keys or not values:
        raise UnreachableFraction("vector codes: no layer caches both key and value latents", 0.0)
    index = {l.layer: i for i, l in enumerate(full.layers)}
    k_energy, v_energy = key_energies(inputs, options), value_energies(inputs)

    def weight(side: Side) -> torch.Tensor:
        if weights is not None:
            return weights[side]
        return (k_energy if side[1] == "k" else v_energy)[index[side[0]]]

    k_bits, v_bits = vector_bits([weight(s) for s in keys], [weight(s) for s in values],
                                 [rho[s] for s in keys], [rho[s] for s in values],
                                 code_budget(full, options), key_share, tuple_dims)
    layers = list(full.layers)
    for (layer, side), bits in [*zip(keys, k_bits), *zip(values, v_bits)]:
        i = index[layer]
        energy = (k_energy if side == "k" else v_energy)[i]
        layers[i] = _coded(layers[i], side, bits, books[layer, side], energy, tuple_dims)
    plan = replace(full, layers=layers, options=options, kind="vector")
    plan.reachable = (plan.size_as_asked, plan.size_as_asked)
    return plan


def vector_candidate(model: nn.Module, blocks: list[AttentionBlock], options: PlanOptions,
                     inputs: list[LayerInput], note: str) -> tuple[Plan, float]:
    """The vector plan at ``options``' budget (``options.rope`` resolved to ``reconstruct``,
    its basis to the one ``inputs`` carry) with the least held-out loss over the channels'
    weights (the spectra's energies, the loss's sensitivities where measurable) and the keys'
    share of ``KEY_SHARES``, and that loss."""
    full = plan_layers(inputs, replace(options, cache_fraction=1.0, bits_per_value=None,
                                       latent_bits=16, key_fraction=None))
    calibration = options.calibration
    windows = calibration_windows(calibration_tokenizer(model, calibration), calibration, model)
    books, rho = fitted_books(model, blocks, full, windows)
    weightings = {"the spectra's energies": None}
    sensitivities = latent_sensitivities(model, blocks, full, _coded_sides(full), windows)
    if sensitivities is not None:
        weightings["the loss's sensitivities"] = sensitivities
    best = None
    for (name, weights), share in itertools.product(weightings.items(), KEY_SHARES):
        plan = vector_plan(full, inputs, options, books, rho, share, weights)
        loss = held_out_loss(model, blocks, plan)
        log.info("vector codes, channels weighed by %s, keys' share %.2f: held-out loss %.4f",
                 name, share, loss)
        if best is None or loss < best[0]:
            best = (loss, plan)
    loss, plan = best
    plan.basis_note = note
    return plan, loss
