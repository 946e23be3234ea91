"""The vector scheme's codebooks: fitted on calibration latents, cached on disk per model.

The calibration windows run once through the latent cache of the full-rank plan (keys before
RoPE); every layer's cached latents, less each window's first token (the sink, never coded),
are the samples. Per side and per width of ``WIDTHS`` a book is fitted on them
(``codes.vector.fit``: k-means per sub-vector, reconstructions keeping each channel's
variance) and its relative squared error per channel measured on the same samples; the
scheme's allocation cuts each layer's book from those (``codes.vector.select``).

Why these constants (bench/results/bit_waterfill-cpu.md, fake-quantized on news, Austen and
poems with the share chosen on the planner's held-out windows): tuples of 16 channels and
half-bit widths gave the least loss at 2.56 and 1.92 bits per value.
"""
from __future__ import annotations

import hashlib
import json
import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.codes.vector import VectorBook, VectorSpec, fit, reconstruction
from lorc_fx.data.models import user_cache_dir
from lorc_fx.kernels.nearest_codeword import nearest_codeword
from lorc_fx.plan.calibration import model_fingerprint, sampling_key, save_atomic
from lorc_fx.plan.planner import Plan
from lorc_fx.plan.sensitivity import Side, latent_sensitivities

from .windows import through_cache

WIDTHS = (0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6)  # bits a channel a book is fitted at
TUPLE_DIMS = 16  # channels allocated one width together (the longest sub-vector)
FIT_ITERATIONS = 15  # Lloyd iterations per book

_FORMAT = 3  # bump when what fitted_books computes changes (2: the coding errors kept too;
# 3: the bases kept too, compared on reading)
BASES_ATOL = 1e-6  # bases this close to those the books were fitted under reuse them: the same
# calibration at another thread count moved the default model's by at most 4e-12

Books = dict[Side, dict[float, VectorBook]]

log = logging.getLogger(__name__)


def coded_sides(plan: Plan) -> list[Side]:
    """The sides of ``plan`` that vector codes may store: every compressible side of a layer
    not skipped."""
    return [(l.layer, side) for l in plan.layers if not l.skipped
            for side, ok in (("k", l.k_compressible), ("v", l.v_compressible)) if ok]


@torch.no_grad()
def calibration_latents(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                        windows: torch.Tensor) -> dict[Side, torch.Tensor]:
    """Per coded side of ``full`` (a full-rank, unquantized plan), its cached latents on
    ``windows`` as ``(samples, r)`` float32, each window's first token left out."""
    samples: dict[Side, list[torch.Tensor]] = {}
    for _, _, cache in through_cache(model, blocks, full, windows):
        for layer, side in coded_sides(full):
            latent = cache.layers[layer].latents()["kv".index(side)]
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
                books[key][b] = fit(x, VectorSpec(((x.shape[1], b),), tuple_dims), iters=iters,
                                    assign=nearest_codeword)
                bar.update()
    return books


def _bases(full: Plan) -> dict[str, torch.Tensor]:
    """The basis of every coded side of ``full``, by ``"layer/side"``."""
    layers = {l.layer: l for l in full.layers}
    return {f"{layer}/{side}": getattr(layers[layer], f"{side}_basis")
            for layer, side in coded_sides(full)}


def _books_file(model: nn.Module, full: Plan, what: str = "vector"):
    """Where the books of ``model`` fitted on the latents of ``full`` are cached (``what``:
    ``"vector"``; ``"sensitivity"``, the loss's sensitivities beside them): keyed by the
    model and the calibration text (the bases they were fitted under are kept in the file and
    compared on reading: their bytes vary with the thread count)."""
    key = json.dumps({"format": _FORMAT, "model": model_fingerprint(model),
                      "calibration": repr(full.options.calibration),
                      **sampling_key(full.options.calibration), "basis": full.options.basis,
                      "rope": full.options.rope, "widths": WIDTHS, "tuple_dims": TUPLE_DIMS,
                      "iters": FIT_ITERATIONS}, sort_keys=True)
    return user_cache_dir() / "calibration" / f"{what}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.pt"


def _fitted_under(data: dict, bases: dict[str, torch.Tensor]) -> bool:
    """Whether cached books were fitted under ``bases`` (to ``BASES_ATOL``)."""
    kept = data.get("bases", {})
    return all(name in kept and kept[name].shape == basis.shape
               and torch.allclose(kept[name].double(), basis.double(), rtol=0, atol=BASES_ATOL)
               for name, basis in bases.items())


def _read_books(data: dict, full: Plan) -> tuple[Books, dict[Side, dict[float, torch.Tensor]]]:
    """The books and coding errors of every coded side of ``full`` in a books file's ``data``."""
    books, rho = {}, {}
    for layer, side in coded_sides(full):
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
    windows nor measures again (else fitted, ~3.5 min at one thread for the default model, and
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
        out[key] = {b: ((reconstruction(x, book, nearest_codeword) - x).double() ** 2).sum(0)
                    / power for b, book in books[key].items()}
    return out


def measured_sensitivities(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                           windows: torch.Tensor) -> dict[Side, torch.Tensor] | None:
    """:func:`~lorc_fx.plan.sensitivity.latent_sensitivities` of every coded side of ``full``
    on ``windows``, from the disk cache beside the books where measured before under the same
    bases (else measured, a forward and backward per batch of windows: ~1 min at one thread
    on the default model, and written there)."""
    path, bases = _books_file(model, full, "sensitivity"), _bases(full)
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if _fitted_under(data, bases):
            return {(layer, side): data["sensitivities"][f"{layer}/{side}"]
                    for layer, side in coded_sides(full)}
    measured = latent_sensitivities(model, blocks, full, coded_sides(full), windows)
    if measured is not None:
        save_atomic({"sensitivities": {f"{layer}/{side}": weight
                                       for (layer, side), weight in measured.items()},
                     "bases": bases}, path)
        log.info("vector codes: the loss's sensitivities kept in %s", path)
    return measured
