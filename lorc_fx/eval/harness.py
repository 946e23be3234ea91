"""The compressed model under EleutherAI's lm-evaluation-harness (``pip install lm_eval``;
the ``harness`` extra), on a local task: rolling log-likelihood (word and byte perplexity,
bits per byte) over documents of a text's evaluation part. Nothing is downloaded.

The harness scores log-likelihoods through ``HFLM._model_call``, a plain forward, which a
model prepared by ``lorc_fx.compress`` runs uncompressed (``compress`` changes only the
cache ``generate`` builds). :class:`LatentCacheLM` is ``HFLM`` with that call made through a
fresh latent cache read back as stored (``prefill_as_stored``: a prefill would attend its own
tokens as it computed them), so every token attends to compressed keys and values as in
decoding;
``generate_until`` tasks need no change, since ``generate`` builds the latent cache itself.

``write_task`` writes the documents as JSON lines beside a task YAML, so the same task also
runs from the harness's own command line on any model:
``lm_eval --model hf --model_args pretrained=DIR --include_path TASK_DIR --tasks TASK``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from lorc_fx.cache import latent_cache
from lorc_fx.data.texts import evaluation_part, split_paragraphs

METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""


class LatentCacheLM(HFLM):
    """``HFLM`` whose log-likelihood forward runs through a fresh latent cache."""

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:
            raise ValueError("LatentCacheLM scores decoder-only models; this call is seq2seq")
        with torch.no_grad():
            return self.model(inps, past_key_values=latent_cache(self.model,
                                                                 prefill_as_stored=True),
                              use_cache=True).logits


def documents(text: str, count: int, words: int) -> list[str]:
    """The first ``count`` documents of at least ``words`` words, each consecutive paragraphs
    of ``text``'s evaluation part (never a paragraph calibration reads); a text too short for
    them is refused."""
    docs, current = [], []
    for paragraph in split_paragraphs(evaluation_part(text)):
        current.append(paragraph)
        if sum(len(p.split()) for p in current) >= words:
            docs.append("\n\n".join(current))
            current = []
            if len(docs) == count:
                return docs
    raise ValueError(f"its evaluation part holds {len(docs)} documents of {words} words, "
                     f"fewer than the {count} asked; ask for fewer or shorter documents")


def write_task(name: str, docs: list[str], directory: str | Path) -> str:
    """``lorc_<name>.jsonl`` and the task ``lorc_<name>`` in ``directory`` (the ``datasets``
    cache of the task lives there too); the task's name."""
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    task = "lorc_" + "".join(c if c.isalnum() else "_" for c in name)
    data = directory / f"{task}.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    (directory / f"{task}.yaml").write_text(
        TASK_YAML.format(task=task, data=json.dumps(str(data)),
                         cache=json.dumps(str(directory / "datasets-cache"))))
    return task


def harness_scores(model, tokenizer, task: str, task_dir: str | Path, compressed: bool,
                   max_length: int = 512, batch_size: int = 1) -> dict[str, float]:
    """The task's metrics for ``model`` through ``HFLM`` (``compressed``: through
    :class:`LatentCacheLM`), documents cut into disjoint windows of ``max_length`` tokens."""
    wrapper = LatentCacheLM if compressed else HFLM
    lm = wrapper(pretrained=model, tokenizer=tokenizer, max_length=max_length,
                 batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=[task],
                          task_manager=TaskManager(include_path=str(task_dir),
                                                   include_defaults=False),
                          bootstrap_iters=0, log_samples=False)
    results = out["results"][task]
    return {metric: float(results[f"{metric},none"]) for metric in METRICS}
