"""A keys_waterfilled plan through the caches and the compiler: key latents (before RoPE)
stored in runs of 8/4/3-bit codes, values as plain 4-bit quantization per token.

The plan is built as ``search.key_bits`` builds it (rounding errors measured through the
latent cache of the full-rank plan, rows water-filled), on a tiny random llama, with groups of
8 tokens so that a short generation settles several.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from lorc_fx.analysis import analyze
from lorc_fx.analysis.records import named_params
from lorc_fx.api import compress, load_plan, save_plan
from lorc_fx.cache.latent_ops import DEQUANTIZE, dequantize_codes_math
from lorc_fx.cache import latent_cache
from lorc_fx.codes.integer import SplitTensor
from lorc_fx.cache.stores.integer import IntegerStore
from lorc_fx.cache.stores.integer_static import IntegerStaticStore
from lorc_fx.compile.backend import lorc_backend
from lorc_fx.plan.options import PlanOptions
from lorc_fx.plan.planner import key_energies, layer_inputs
from lorc_fx.plan.schedules import UnreachableFraction
from lorc_fx.schemes.keys_waterfilled import rounding_errors, waterfilled_plan
from helpers.families import VOCAB, build, config_for
from helpers.pass_helpers import compiled, generate, prompt

WIDTHS, GROUP = (3, 4, 8), 8
BUDGET = 9.0  # bits per value: a tiny model's values (a head of 8 channels a group) take 8


@pytest.fixture(scope="module")
def model():
    return build(config_for("llama", heads=4, kv_heads=2, layers=2))


def waterfilled(model, budget: float = BUDGET):
    """The keys_waterfilled plan of ``model`` at ``budget`` bits per value, from its
    full-rank weight basis, rounding errors measured on random tokens."""
    full = compress(model, 1.0, schedule="uniform", basis="weight", rope="reconstruct").plan
    blocks = analyze(model)
    windows = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    rho = rounding_errors(model, blocks, full, windows, WIDTHS, GROUP)
    energies = key_energies(layer_inputs(named_params(model), blocks), full.options)
    options = PlanOptions.of(full.options, bits_per_value=budget, latent_bits=4, latent_group=64)
    return waterfilled_plan(full, energies, rho, options, WIDTHS, GROUP)


@pytest.fixture(scope="module")
def plan(model):
    return waterfilled(model)


def test_the_plan_keeps_rows_in_runs_of_one_width_within_the_budget(plan):
    assert plan.scheme.name == "keys_waterfilled"
    assert BUDGET - 0.5 < plan.bits_per_value <= BUDGET + 1e-9
    widths = set()
    for l in plan.layers:
        assert sum(rows for rows, _ in l.k_code.parts) == l.k_rank == len(l.k_basis) > 0
        bits = [b for _, b in l.k_code.parts]
        assert bits == sorted(set(bits), reverse=True)  # one run per width, widest first
        widths |= set(bits)
        assert l.v_rank == l.v_full and torch.equal(l.v_basis, torch.eye(l.v_full, dtype=torch.float64))
    assert len(widths) > 1  # the budget buys several widths here, not one


def test_measured_bytes_are_the_plans(model, plan):
    """Whole groups: the plan's bytes exactly (values and keys settle together)."""
    report = compress(model, plan=plan)
    assert "keys water-filled" in str(report)
    per_token = report.cache_bytes_per_token()[1]
    for batch, length in ((2, 2 * GROUP), (1, 5 * GROUP)):
        cache = latent_cache(model)
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (batch, length)),
                  position_ids=torch.arange(length).expand(batch, length), past_key_values=cache,
                  use_cache=True)
        layer = cache.layers[0]
        assert isinstance(layer.k_store, IntegerStore)
        assert isinstance(layer.k_store.quantized, SplitTensor)
        assert cache.cache_bytes() == batch * length * per_token


def test_generate_eager_compiled_static_beams_and_a_plan_file(model, plan, tmp_path):
    """The compiled decode (the passes, without Inductor) gives the eager tokens without a
    graph break, reading the values from their codes and the keys' runs dequantized into the
    rebuild; static caches and beams run; a saved plan installs the same cache."""
    compress(model, plan=plan)
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, new_tokens=40)
    assert eager.past_key_values.layers[0].k_store.quantized is not None
    backend = lorc_backend.with_options(inductor=False)
    graphs = []
    counters.clear()
    with compiled(model, lambda gm, inputs: graphs.append(gm) or backend(gm, inputs)):
        got = generate(model, ids, mask, new_tokens=40)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(got.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)
    layers = model.config.num_hidden_layers
    assert all(r.absorbed == layers for r in backend.reports[1:])
    # what is left dequantized (lowered to maths) in decode graphs: the key runs, not values
    lowered = [n for gm in graphs[1:] for n in gm.graph.nodes
               if n.target in (DEQUANTIZE, dequantize_codes_math)]
    assert lowered and all(n.args[5] == -2 for n in lowered)  # per channel: keys

    static = generate(model, ids, mask, "static", new_tokens=12)
    assert all(isinstance(l.k_store, IntegerStaticStore) for l in static.past_key_values.layers)
    first, want = static.logits[0], eager.logits[0]  # the prefill's logits: whole groups agree
    assert (first - want).abs().max() / want.abs().max() < 0.25
    beams = generate(model, ids, mask, new_tokens=4, num_beams=2)
    assert beams.sequences.shape == (2, 10)

    path = save_plan(plan, tmp_path / "plan")
    loaded = load_plan(path)
    assert loaded.scheme.name == "keys_waterfilled"
    assert [l.k_code for l in loaded.layers] == [l.k_code for l in plan.layers]
    compress(model, plan=path)
    again = generate(model, ids, mask, new_tokens=40)
    assert torch.equal(again.sequences, eager.sequences)


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_generate_matches_eager():
    """Through Inductor (C++ on CPU): the eager tokens, no graph break (one layer: the
    compile is what takes the time, minutes for two)."""
    model = build(config_for("llama", heads=4, kv_heads=2, layers=1))
    compress(model, plan=waterfilled(model))
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, new_tokens=24)
    counters.clear()
    with compiled(model, lorc_backend):
        got = generate(model, ids, mask, new_tokens=24)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(got.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(eager.logits),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt_neox", "phi3", "gpt2"])
def test_other_families_cache_what_they_plan_and_compile_to_the_eager_tokens(family):
    """Partial RoPE (half the dims rotated), no RoPE (keys' latents after the projection):
    whole groups hold the plan's bytes, and the compiled decode gives the eager tokens."""
    model = build(config_for(family, heads=4, kv_heads=4, layers=2, rotary=0.5))
    plan = waterfilled(model, budget=8.0)
    assert all(l.k_code.parts for l in plan.layers)
    report = compress(model, plan=plan)
    cache = latent_cache(model)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (2, 2 * GROUP)), past_key_values=cache, use_cache=True,
              position_ids=torch.arange(2 * GROUP).expand(2, -1))  # angles per row, as generate
    assert cache.cache_bytes() == 2 * 2 * GROUP * report.cache_bytes_per_token()[1]
    ids, mask = prompt(length=6)
    eager = generate(model, ids, mask, new_tokens=20)
    with compiled(model, lorc_backend.with_options(inductor=False)):
        got = generate(model, ids, mask, new_tokens=20)
    assert torch.equal(got.sequences, eager.sequences)


def test_keys_behind_a_norm_leave_nothing_to_water_fill():
    """Keys behind a norm stay raw under a weight basis: the plan is refused, said so."""
    model = build(config_for("qwen3"))
    with pytest.raises(UnreachableFraction, match="no layer caches key latents"):
        waterfilled(model)
