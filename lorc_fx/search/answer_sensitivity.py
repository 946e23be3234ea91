"""How much the answers of retrieval prompts mind an error in each cached latent channel: the
text sensitivities' weight (``plan.sensitivity``), its loss the answer tokens' alone.

The held-out loss weighs every token of ordinary text alike; a long context's question is
answered from a few tokens far back, whose keys ordinary text hardly reads. Weighed by text
alone, the default model's 1.92-bit vector plans answered 52% of what the full cache answers
on held-out variable-tracking prompts at 8k tokens (five calibration draws); with these
weights added as the vector scheme chooses them, 72% (docs/retrieval.md, "The answers' weights
in the planner").

Measured on the uncompressed model, in the text sensitivities' unit (a weight of each
channel's relative error): ``PROMPTS`` multikey prompts (``data.retrieval_tasks``) of
``LENGTH`` tokens and a seed of their own (``SEED``, none an evaluation draws, never of the
held-out family), one forward and backward each of the prompt and its answer, the loss the
answer tokens' summed; the gradients at the K and V projections' outputs at the positions a
vector cache codes (the sink, the recent window and the last partial block left out), carried
into the latent by the basis' rebuild rows, ``F_c = mean over prompts of Σ_t (B·g_t)_c²``,
times the channel's power ``E[z_c²]`` on the first ``POWER_WINDOWS`` calibration windows.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from tqdm.auto import tqdm

from lorc_fx.analysis.records import AttentionBlock
from lorc_fx.codes.vector import BLOCK
from lorc_fx.data.retrieval_tasks import make_samples
from lorc_fx.plan.planner import Plan
from lorc_fx.plan.sensitivity import ProjectionRecorder, Side, projection_rows

from .one_prefill import prompt_length

TASK = "multikey"
SEED = "fisher"  # evaluations draw integer seeds, the retrieval probe "planner"
PROMPTS = 16
LENGTH = 2048  # tokens of prompt and answer (the model's context limit where shorter)
POWER_WINDOWS = 8  # calibration windows the channels' power is measured on


def answer_length(model: nn.Module) -> int | None:
    """The prompts' length for ``model`` (:func:`~.one_prefill.prompt_length` of
    ``LENGTH``)."""
    return prompt_length(model, LENGTH)


def coded_positions(n: int, recent_divisor: int) -> slice:
    """The positions of an ``n``-token prompt a vector cache codes: past the sink, short of
    its recent window (``n // recent_divisor``, none where 0) and last partial block."""
    recent = n // recent_divisor if recent_divisor else 0
    return slice(1, n - recent - BLOCK)


def last_logits(model: nn.Module, count: int) -> dict[str, int]:
    """The keyword that has ``model`` compute its last ``count`` positions' logits alone
    (transformers' ``logits_to_keep``), none where its forward takes no such argument: the
    whole prompt's logits and their gradient took 1.1 GB more on the default model."""
    takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": count} if takes else {}


def _bases(full: Plan, sides: list[Side], what: str) -> dict[Side, torch.Tensor]:
    layer = {l.layer: l for l in full.layers}
    return {s: getattr(layer[s[0]], f"{s[1]}_{what}").double() for s in sides}


@torch.no_grad()
def channel_power(model: nn.Module, blocks: list[AttentionBlock], full: Plan, sides: list[Side],
                  windows: torch.Tensor) -> dict[Side, torch.Tensor]:
    """Per side, each latent channel's mean square ``E[z_c²]`` on the first
    ``POWER_WINDOWS`` of ``windows`` (each window's first token left out)."""
    basis = _bases(full, sides, "basis")
    device = next(model.parameters()).device
    power: dict[Side, torch.Tensor | float] = {s: 0.0 for s in sides}
    tokens = 0
    with ProjectionRecorder(model, blocks, sides, keep_rows=False) as recorder:
        for batch in windows[:POWER_WINDOWS].split(2):
            model(batch.to(device), use_cache=False)
            for side, (name, rows) in recorder.reads.items():
                y = projection_rows(recorder.outputs[name], rows).cpu()
                power[side] = power[side] + ((y @ basis[side].T) ** 2).sum(0)
            tokens += batch[:, 1:].numel()
            recorder.forget()
    return {s: p / tokens for s, p in power.items()}


def answer_fisher(model: nn.Module, tokenizer, blocks: list[AttentionBlock], full: Plan,
                  sides: list[Side], length: int, recent_divisor: int
                  ) -> dict[Side, torch.Tensor]:
    """Per side, ``F_c``: the mean over the prompts of the answer loss's squared gradient by
    each latent channel, summed over the coded positions (shows progress)."""
    rebuild = _bases(full, sides, "rebuild")
    device = next(model.parameters()).device
    fisher: dict[Side, torch.Tensor | float] = {s: 0.0 for s in sides}
    samples = make_samples(tokenizer, TASK, length, PROMPTS, SEED)
    with ProjectionRecorder(model, blocks, sides, keep_rows=False,
                            recompute_layers=True) as recorder:
        for sample in tqdm(samples, desc="lorc: measuring the retrieval answers' sensitivity "
                           "to each latent channel", unit="prompt", mininterval=1.0):
            ids, answer = sample.input_ids, sample.answer_ids(tokenizer)
            n, scored = len(ids), len(answer) + 1  # the answer's logits, and the last one's
            with torch.enable_grad():
                logits = model(torch.tensor([ids + answer], device=device), use_cache=False,
                               **last_logits(model, scored)).logits[0, -scored:-1].float()
                torch.nn.functional.cross_entropy(logits, torch.tensor(answer, device=device),
                                                  reduction="sum").backward()
            coded = coded_positions(n, recent_divisor)
            for side, (name, rows) in recorder.reads.items():
                g = recorder.shifts[name].grad[0, coded].index_select(-1, rows).double().cpu()
                fisher[side] = fisher[side] + ((g @ rebuild[side].T) ** 2).sum(0)
            recorder.forget()
    return {s: f / len(samples) for s, f in fisher.items()}


def answer_sensitivities(model: nn.Module, tokenizer, blocks: list[AttentionBlock], full: Plan,
                         sides: list[Side], windows: torch.Tensor, length: int,
                         recent_divisor: int) -> dict[Side, torch.Tensor]:
    """Per side of ``sides`` (coded by the full-rank ``full``, each latent linear in its
    projection), ``F_c·E[z_c²]`` of each latent channel, float64 (the module's docstring)."""
    power = channel_power(model, blocks, full, sides, windows)
    fisher = answer_fisher(model, tokenizer, blocks, full, sides, length, recent_divisor)
    return {s: fisher[s] * power[s] for s in sides}


def with_answers(text: dict[Side, torch.Tensor], answers: dict[Side, torch.Tensor],
                 weight: float) -> dict[Side, torch.Tensor]:
    """The text's weights plus the answers', scaled per kind (keys apart from values) to
    ``weight`` times the text's total: the answers' spread over channels and layers, at a
    share of the text's the caller chooses."""
    mixed = {}
    for kind in ("k", "v"):
        sides = [s for s in text if s[1] == kind]
        total = sum(float(answers[s].sum()) for s in sides)
        scale = sum(float(text[s].sum()) for s in sides) / total if total > 0 else 0.0
        for s in sides:
            mixed[s] = text[s] + weight * scale * answers[s].to(text[s].dtype)
    return mixed
