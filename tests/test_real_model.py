"""The compiler pass on the real default model (SmolLM2-135M): slow, run by CI."""
import pytest
import torch
from torch._dynamo.utils import counters

import lorc_fx
from lorc_fx.data.models import ModelNotFoundError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_tokenizer():
    try:
        return lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    except ModelNotFoundError as err:
        pytest.skip(str(err))


def test_compiled_generate_matches_eager_with_half_the_cache(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    report = lorc_fx.compress(model, cache_fraction=0.5)
    inputs = tokenizer("The history of the printing press begins", return_tensors="pt")
    generate = lambda: model.generate(**inputs, max_new_tokens=32, min_new_tokens=32,
                                      do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        eager = generate()
        torch._dynamo.reset()
        counters.clear()
        model.compile(backend=lorc_fx.lorc_backend)
        try:
            compiled = generate()
        finally:
            model._compiled_call_impl = None
            torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] <= 3  # prefill, first decode, dynamic decode
    cache = compiled.past_key_values
    full = sum(l.k_full + l.v_full for l in report.plan.layers) * cache.get_seq_length() * 4
    assert abs(cache.cache_bytes() / full - 0.5) <= 0.01
