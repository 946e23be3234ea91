"""The ``lorc`` command line on a tiny local model directory."""
import json

import pytest

from lorc_fx.cli import main
from helpers.families import build, config_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build(config_for("llama", heads=4, kv_heads=2, layers=3)).save_pretrained(path)
    return str(path)


def test_plan_json_and_plot(model_dir, tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--model", model_dir, "--cache-fraction", "0.75", "--json", str(out),
                 "--plot", str(png), "--rank-multiple", "1"]) == 0
    data = json.loads(out.read_text())
    assert abs(data["cache_fraction"] - 0.75) <= 0.02
    assert len(data["layers"]) == 3
    assert {"layer", "k_rank", "v_rank", "k_full", "v_full", "skipped"} <= set(data["layers"][0])
    assert png.stat().st_size > 1000
    assert "cache fraction" in capsys.readouterr().out


def test_analyze_json(model_dir, tmp_path):
    out = tmp_path / "blocks.json"
    assert main(["analyze", "--model", model_dir, "--json", str(out)]) == 0
    blocks = json.loads(out.read_text())
    assert [b["supported"] for b in blocks] == [True] * 3
    assert (blocks[0]["num_heads"], blocks[0]["num_kv_heads"]) == (4, 2)


@pytest.mark.parametrize("args, message", [
    (["--cache-fraction", "1.5"], "cache_fraction must be in (0, 1]"),
    (["--schedule", "pyramid"], "unknown schedule"),
    (["--skip-threshold", "-3"], "skip_threshold"),
])
def test_invalid_options_exit_2_with_a_message(model_dir, args, message, capsys):
    assert main(["plan", "--model", model_dir, *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert "not a model directory or .gguf file" in capsys.readouterr().err
