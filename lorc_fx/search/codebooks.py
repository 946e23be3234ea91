"""The vector scheme's codebooks: fitted on calibration latents, cached on disk per model.

The calibration windows run once through the model, forward and backward: every layer's
latents of the full-rank plan (keys before RoPE), less each window's first token (the sink,
never coded), are the samples, and the gradients give the loss's sensitivities
(``plan.sensitivity``) in the same pass. Per side and per width of ``WIDTHS`` a book is
fitted on them (``codes.vector.fit``: k-means per sub-vector, reconstructions keeping each
channel's variance) and its relative squared error per channel measured on the same
samples; the scheme's allocation cuts each layer's book from those (``codes.vector.select``).

Why these constants (bench/results/bit_waterfill-cpu.md, fake-quantized on news, Austen and
poems with the share chosen on the planner's held-out windows): tuples of 16 channels and
half-bit widths gave the least loss at 2.56 and 1.92 bits per value.
"""
from __future__ import annotations

import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.codes.vector import VectorBook, VectorSpec, fit_measured
from lorc_fx.kernels.nearest_codeword import nearest_codeword
from lorc_fx.plan.calibration import (calibration_file, model_fingerprint, sampling_key,
                                      save_atomic)
from lorc_fx.plan.planner import Plan
from lorc_fx.plan.sensitivity import (ProjectionMoments, Side, sensitivities,
                                      sensitivities_and_latents)

from . import answer_sensitivity as answers
from .windows import through_cache

WIDTHS = (0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6)  # bits a channel a book is fitted at
TUPLE_DIMS = 16  # channels allocated one width together (the longest sub-vector)
FIT_ITERATIONS = 15  # Lloyd iterations per book

_FORMAT = 4  # bump when what books_and_sensitivities computes changes (2: the coding errors
# kept too; 3: the bases kept too, compared on reading; 4: k-means' coarse steps)
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
              tuple_dims: int = TUPLE_DIMS, iters: int = FIT_ITERATIONS, tails: bool = False
              ) -> tuple[Books, dict[Side, dict[float, torch.Tensor]]]:
    """Per side, a book of its whole latent at each width, and its coding errors on the
    samples: each channel's squared error over its squared values (shows progress; ``tails``:
    the scalar tables keep levels past the samples' range, ``codes.vector.TAIL_REACH``).

    The books are fitted side by side, one a thread, each with one thread of its own
    (``torch.set_num_threads(1)`` while they run): a book's Lloyd steps are small products
    that two threads share poorly, and a book fitted alone on one thread does not depend on
    how many the machine runs."""
    power = {side: (x.double() ** 2).sum(0).clamp_min(1e-30) for side, x in samples.items()}

    def fit(side: Side, width: float) -> tuple[VectorBook, torch.Tensor]:
        x = samples[side]
        book, squared = fit_measured(x, VectorSpec(((x.shape[1], width),), tuple_dims),
                                     iters=iters, assign=nearest_codeword, tails=tails)
        return book, squared / power[side]

    jobs = [(side, width) for side in samples for width in widths]
    books: Books = {side: {} for side in samples}
    errors: dict[Side, dict[float, torch.Tensor]] = {side: {} for side in samples}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool, \
                tqdm(total=len(jobs), desc="lorc: fitting vector codebooks", unit="book") as bar:
            for (side, width), (book, error) in zip(jobs, pool.map(lambda job: fit(*job), jobs)):
                books[side][width], errors[side][width] = book, error
                _return_freed_memory()
                bar.update()
    finally:
        torch.set_num_threads(threads)
    return books, errors


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; nothing where
    the C library has none), as each book is fitted: the Lloyd steps' temporaries, freed,
    stayed resident between the books that outlive them, 4 GB over the default model's 540
    books, which hold 1.5 MiB a side (2026-12-08)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc, or no C library to open
        return
    trim(0)


def _bases(full: Plan) -> dict[str, torch.Tensor]:
    """The basis of every coded side of ``full``, by ``"layer/side"``."""
    layers = {l.layer: l for l in full.layers}
    return {f"{layer}/{side}": getattr(layers[layer], f"{side}_basis")
            for layer, side in coded_sides(full)}


def _books_file(model: nn.Module, full: Plan, what: str = "vector", key: dict | None = None):
    """Where the books of ``model`` fitted on the latents of ``full`` are cached (``what``:
    ``"vector"``; ``"sensitivity"`` and ``"answers"``, the loss's and the retrieval answers'
    sensitivities beside them, the latter keyed by ``key`` too): keyed by the model and the
    calibration text (the bases they were fitted under are kept in the file and compared on
    reading: their bytes vary with the thread count; books with tail levels apart from those
    without, the sensitivities shared)."""
    tails = {"tails": True} if what == "vector" and full.options.codebook_tails else {}
    return calibration_file(f"{what}-", {
        "format": _FORMAT, "model": model_fingerprint(model),
        "calibration": repr(full.options.calibration), **sampling_key(full.options.calibration),
        "basis": full.options.basis, "rope": full.options.rope, "widths": WIDTHS,
        "tuple_dims": TUPLE_DIMS, "iters": FIT_ITERATIONS, **tails, **(key or {})})


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


def _cached(model: nn.Module, full: Plan, what: str, key: dict | None = None) -> dict | None:
    """The ``what`` file of ``full`` (:func:`_books_file`) where it was written under the bases
    of ``full`` (``BASES_ATOL``); else ``None``, with a warning where one was written under
    other bases."""
    path = _books_file(model, full, what, key)
    if not path.is_file():
        return None
    data = torch.load(path, weights_only=True)
    if _fitted_under(data, _bases(full)):
        return data
    if what == "vector":
        log.warning("vector codes: the calibrated bases are not those the cached codebooks in "
                    "%s were fitted under; fitting them again", path)
    return None


def _sensitivities(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                   windows: torch.Tensor, keep_latents: bool,
                   projections: ProjectionMoments | None
                   ) -> tuple[dict[Side, torch.Tensor] | None, dict[Side, torch.Tensor] | None]:
    """The loss's sensitivities of every coded side of ``full``, from disk or measured (and
    written there: from ``projections`` where given, else by a pass of their own), and
    where measured with ``keep_latents``, the pass's latents."""
    sides = coded_sides(full)
    data = _cached(model, full, "sensitivity")
    if data is not None:
        return {(l, s): data["sensitivities"][f"{l}/{s}"] for l, s in sides}, None
    if projections is not None:
        measured = sensitivities(projections, blocks, full, sides)
    else:
        measured = sensitivities_and_latents(model, blocks, full, sides, windows,
                                             keep_latents=keep_latents)
    if measured is None:
        return None, None
    path = _books_file(model, full, "sensitivity")
    save_atomic({"sensitivities": {f"{l}/{s}": weight for (l, s), weight in measured[0].items()},
                 "bases": _bases(full)}, path)
    log.info("vector codes: the loss's sensitivities kept in %s", path)
    return measured


def books_and_sensitivities(model: nn.Module, blocks: list[AttentionBlock], full: Plan,
                            windows: torch.Tensor, projections: ProjectionMoments | None = None
                            ) -> tuple[Books, dict[Side, dict[float, torch.Tensor]],
                                       dict[Side, torch.Tensor] | None]:
    """The books fitted on the latents of ``full`` on ``windows``, their coding errors there
    (:func:`fit_books`) and the loss's sensitivities to each latent
    channel (:func:`~lorc_fx.plan.sensitivity.sensitivities_and_latents`; ``None`` where a side's
    latent is not linear in its projection), each read from the disk cache where it was
    computed before under the same bases (``BASES_ATOL``), else computed and written there.

    A first plan runs ``windows`` once for both: one forward and backward per batch gives the
    sensitivities and the latents the books are fitted on, in the calibration pass of the
    bases' statistics where it measured ``projections`` (:func:`~lorc_fx.plan.sensitivity.
    calibration_with_gradients`), else in a pass of its own (:func:`~lorc_fx.plan.
    sensitivity.sensitivities_and_latents`); only where the sensitivities cannot be measured
    do the latents come from a forward through the cache (:func:`calibration_latents`). The
    fit takes ~30 s at two threads on the default model, said once."""
    books_data = _cached(model, full, "vector")
    weights, samples = _sensitivities(model, blocks, full, windows,
                                      keep_latents=books_data is None, projections=projections)
    if books_data is not None:
        return (*_read_books(books_data, full), weights)
    if not samples:
        samples = calibration_latents(model, blocks, full, windows)
    path = _books_file(model, full)
    log.warning("vector codes: fitting codebooks for every coded side at %d widths on %d "
                "calibration latents each (once per model: they are cached in %s)",
                len(WIDTHS), next(iter(samples.values())).shape[0], path.parent)
    books, rho = fit_books(samples, tails=full.options.codebook_tails)
    save_atomic({"books": {f"{layer}/{side}/{b}": list(book.tables[0])
                           for (layer, side), by_width in books.items()
                           for b, book in by_width.items()},
                 "errors": {f"{layer}/{side}/{b}": err for (layer, side), by_width in rho.items()
                            for b, err in by_width.items()},
                 "bases": _bases(full)}, path)
    return books, rho, weights


def kept_answer_sensitivities(model: nn.Module, tokenizer, blocks: list[AttentionBlock],
                              full: Plan, windows: torch.Tensor, length: int
                              ) -> dict[Side, torch.Tensor]:
    """The retrieval answers' sensitivities to every coded side of ``full`` at prompts of
    ``length`` tokens (:func:`~lorc_fx.search.answer_sensitivity.answer_sensitivities`; the
    sides' latents linear in their projections), read from the disk cache where they were
    measured before under the same bases, else measured and written there."""
    sides = coded_sides(full)
    key = {"answers": [answers.TASK, answers.SEED, answers.PROMPTS, length,
                       answers.POWER_WINDOWS, full.options.recent_divisor]}
    data = _cached(model, full, "answers", key)
    if data is not None:
        return {(l, s): data["sensitivities"][f"{l}/{s}"] for l, s in sides}
    measured = answers.answer_sensitivities(model, tokenizer, blocks, full, sides, windows,
                                            length, full.options.recent_divisor)
    path = _books_file(model, full, "answers", key)
    save_atomic({"sensitivities": {f"{l}/{s}": w for (l, s), w in measured.items()},
                 "bases": _bases(full)}, path)
    log.info("vector codes: the retrieval answers' sensitivities kept in %s", path)
    return measured
