"""The compiler pass on the real default model (SmolLM2-135M) cut to its first ``LAYERS``
layers: its real weights, config and tokenizer. The rewrite, the cache and the graphs dynamo
makes are per layer, so the first layers prove what all 30 do, in a fraction of the Inductor
compile (all 30 took 13 and 9 minutes of a 49-minute test run on 2 cores; 6 layers 245 s and
3 layers 160 s for the default options, one worker); ``lorc demo`` compiles the whole model.
Inductor's kernels are vectorized here, as users get them (tests/conftest.py). Slow, run by
CI."""
import pytest
import torch
from torch._dynamo.utils import counters

import lorc_fx
from lorc_fx.data.models import ModelNotFoundError

pytestmark = [pytest.mark.slow, pytest.mark.vectorized]


LAYERS = 3


@pytest.fixture(scope="module")
def model_and_tokenizer():
    try:
        model, tokenizer = lorc_fx.load_model("default"), lorc_fx.load_tokenizer("default")
    except ModelNotFoundError as err:
        pytest.skip(str(err))
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    return model, tokenizer


@pytest.mark.parametrize("latent_bits", ["auto", 16])
def test_compiled_generate_matches_eager_with_half_the_cache(model_and_tokenizer, latent_bits):
    """Default options (at half a float32 cache the planner keeps 8-bit plain quantization,
    0.27 of it) and low rank alone (16-bit latents, half the cache's bytes), over the dynamic
    cache (asked for: compiled in place, ``generate`` would build a static one)."""
    model, tokenizer = model_and_tokenizer
    report = lorc_fx.compress(model, cache_fraction=0.5, latent_bits=latent_bits)
    inputs = tokenizer("The history of the printing press begins", return_tensors="pt")
    generate = lambda: model.generate(**inputs, max_new_tokens=32, min_new_tokens=32,
                                      do_sample=False, return_dict_in_generate=True,
                                      cache_implementation="dynamic")
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
    # prefill, first decode, dynamic decode; quantized: the window growing before a group is
    # stored, and one more where the prompt is shorter than a group (docs/design.md)
    assert counters["stats"]["unique_graphs"] <= (3 if latent_bits == 16 else 5)
    cache = compiled.past_key_values
    tokens = cache.get_seq_length()
    full = sum(l.k_full + l.v_full for l in report.plan.layers) * tokens * 4
    if latent_bits == 16:
        assert abs(cache.cache_bytes() / full - 0.5) <= 0.01
    else:  # whole groups at the plan's rate, the last partial group unquantized
        plan = report.plan
        group = plan.options.latent_group
        whole = tokens // group * group
        expected = whole * plan.cache_bytes_per_token(4)[1] + (tokens - whole) * full / tokens
        assert plan.scheme.name == "plain" and cache.cache_bytes() == pytest.approx(expected, rel=1e-9)
