"""A tiny random Llama saved with a word-level tokenizer, and a text of its words: every
path a user takes (calibration included) runs on it as for a real model, with no downloads."""
from __future__ import annotations

import random

import torch

WORDS = [f"w{i}" for i in range(120)]
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 64


def own_words(make_samples):
    """``make_samples`` (``data.retrieval_tasks``) with each prompt's ids drawn from the tiny
    tokenizer's own words and a four-word answer: it knows none of the prompts' words (every
    token would be <unk>, whose keys differ by position alone)."""
    from dataclasses import replace

    def words(tokenizer, task, length, trials, seed):
        rng = random.Random(0)
        return [replace(s, input_ids=[rng.randrange(3, len(tokenizer)) for _ in s.input_ids],
                        answer="w1 w2 w3 w4")
                for s in make_samples(tokenizer, task, length, trials, seed)]
    return words


def write_text(path, paragraphs=240, words=30, seed=0):
    rng = random.Random(seed)
    # a few frequent words make the token statistics (and so the inputs) correlated
    weights = [1.0 / (i + 1) for i in range(len(WORDS))]
    path.write_text("\n\n".join(" ".join(rng.choices(WORDS, weights, k=words))
                                for _ in range(paragraphs)))
    return str(path)


def save_tokenizer(directory) -> dict[str, int]:
    """A word-level tokenizer of ``WORDS`` (ids 3…) saved in ``directory``; its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="</s>").save_pretrained(directory)
    return vocab


def save_tiny_llama(directory, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = save_tokenizer(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # anisotropic norm scales: strongly correlated K/V inputs
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(torch.logspace(-1, 1, HIDDEN))
    model.save_pretrained(directory)
    return str(directory)
