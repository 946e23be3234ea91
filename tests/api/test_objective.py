"""``objective`` decides which RoPE modes ``rope="auto"`` may pick."""
import pytest

from lorc_fx.analysis import analyze
from lorc_fx.api import compress
from lorc_fx.cache.rotary import frequency_pairs
from lorc_fx.search.context import rope_modes
from lorc_fx.report import plan_table
from helpers.families import build, config_for


def test_speed_plans_only_keys_decode_reads_without_rebuilding():
    """Keys before RoPE in a RoPE-commuting basis, each row on one rotary pair (so decode
    scores them per pair): its cache layers say so, and generate gives the tokens of the
    uncompressed model at full rank."""
    model = build(config_for("llama"))
    blocks = analyze(model)
    assert rope_modes("auto", model, blocks, "quality") == ["commute", "reconstruct"]
    assert rope_modes("auto", model, blocks, "speed") == ["reconstruct"]
    report = compress(model, 0.75, schedule="uniform", basis="weight", objective="speed",
                      blocks=blocks)
    assert report.plan.options.rope == "reconstruct" and report.plan.options.objective == "speed"
    assert all(l.k_latent_of == "pre_rope" for l in report.plan.layers)
    assert "scores them per rotary pair, not rebuilt" in plan_table(report.plan)
    head_dim = report.plan.layers[0].head_dim
    for layer in report.plan.layers:
        assert frequency_pairs(layer.k_rebuild, layer.num_kv_heads, head_dim, "half") is not None


def test_speed_without_rope_plans_the_one_mode():
    model = build(config_for("gpt2"))
    assert rope_modes("auto", model, analyze(model), "speed") == ["commute"]


def test_a_reconstruct_plan_states_its_decode_cost():
    model = build(config_for("llama"))
    report = compress(model, 0.75, schedule="uniform", basis="weight", rope="reconstruct")
    assert "rebuilt over the whole context every decode step" in plan_table(report.plan)
    model = build(config_for("llama"))
    report = compress(model, 0.75, schedule="uniform", basis="weight", rope="commute")
    assert "rebuilt" not in plan_table(report.plan)


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="unknown objective 'fast'; choose from"):
        compress(build(config_for("llama")), 0.75, objective="fast")
