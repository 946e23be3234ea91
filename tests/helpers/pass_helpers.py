"""Generation helpers shared by the compiler-pass tests."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch._dynamo

from helpers.families import VOCAB


def prompt(batch: int = 2, length: int = 6, seed: int = 0):
    """Token ids and an attention mask with the second row left-padded by two tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def generate(model, ids, mask, cache=None, new_tokens: int = 3, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              cache_implementation=cache, **kwargs)


@contextmanager
def compiled(model, backend):
    """``model.forward`` compiled with ``backend`` for the duration (generate calls forward)."""
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        yield
    finally:
        del model.forward
        torch._dynamo.reset()


def assert_same_generation(got, expected, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits),
                               atol=atol, rtol=rtol)
    assert torch.equal(got.sequences, expected.sequences)
