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
                 "--plot", str(png), "--rank-multiple", "1", "--latent-bits", "16"]) == 0
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


@pytest.mark.parametrize("command, args, message", [
    ("plan", ["--cache-fraction", "1.5"], "cache_fraction must be a number in (0, 1], got 1.5"),
    ("plan", ["--schedule", "pyramid"], "unknown schedule 'pyramid'"),
    ("plan", ["--skip-threshold", "-3"], "skip_threshold"),
    ("plan", ["--rank-multiple", "0"], "rank_multiple must be an integer >= 1"),
    ("plan", ["--rope", "sideways"], "unknown rope mode 'sideways'"),
    ("plan", ["--calibration-tokens", "0"], "calibration tokens must be an integer >= 1"),
    ("eval", ["--prompts", "-1"], "prompts must be an integer >= 0, got -1"),
    ("eval", ["--window", "0"], "window must be an integer >= 2, got 0"),
    ("eval", ["--tokens", "100"], "tokens must be an integer >= 512, got 100"),
    ("eval", ["--new-tokens", "0"], "new_tokens must be an integer >= 1"),
    ("sweep", ["--fractions", "0.5,2"], "--fractions must be numbers in (0, 1]"),
    ("demo", ["--cache-fraction", "0"], "cache_fraction must be a number in (0, 1]"),
    ("plan", ["--bits-per-value", "20"], "bits_per_value must be a number in [0.5, 16]"),
    ("eval", ["--bits-per-value", "0.2"], "bits_per_value must be a number in [0.5, 16]"),
    ("eval", ["--latent-bits", "6"], "latent_bits must be one of [16, 8, 4, 'auto'], got 6"),
    ("lm-eval", ["--docs", "0"], "--docs must be an integer >= 1, got 0"),
    ("lm-eval", ["--max-length", "-2"], "--max-length must be an integer >= 1, got -2"),
    ("lm-eval", ["--cache-fraction", "2"], "cache_fraction must be a number in (0, 1]"),
])
def test_invalid_options_exit_2_before_the_model_loads(tmp_path, command, args, message, capsys):
    """The model path does not exist: a message about the option proves it was never loaded."""
    model = [] if command == "demo" else ["--model", str(tmp_path / "never-loaded")]
    assert main([command, *model, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "not a model directory" not in err


@pytest.mark.parametrize("command", ["plan", "eval", "demo"])
@pytest.mark.parametrize("first, second", [("--cache-fraction", "--bits-per-value"),
                                           ("--bits-per-value", "--max-ppl-increase")])
def test_the_ways_to_say_the_budget_are_exclusive(command, first, second, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, first, "0.5", second, "0.5"])
    assert exit_.value.code == 2
    assert f"{second}: not allowed with argument {first}" in capsys.readouterr().err


def test_plan_json_at_a_bit_budget(model_dir, tmp_path):
    """Fixed latent bits: the budget in bits per value, everything counted."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", model_dir, "--bits-per-value", "6", "--latent-bits", "8",
                 "--latent-group", "32", "--rope", "commute", "--rank-multiple", "1",
                 "--basis", "weight", "--schedule", "uniform", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["requested_bits_per_value"] == 6 and data["requested_fraction"] is None
    assert abs(data["bits_per_value"] - 6) <= 9 / 32  # within one rank of 9-bit latents
    assert data["options"]["latent_bits"] == 8 and data["kind"] == "low_rank"


def test_lm_eval_without_the_harness_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    assert main(["lm-eval", "--model", str(tmp_path / "never-loaded")]) == 2
    assert "pip install 'lorc-fx[harness]'" in capsys.readouterr().err


def test_every_option_is_explained_with_its_default():
    from lorc_fx.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"lorc {name} {action.option_strings}: no help"
        assert "(default:" in sub.format_help() or name.startswith("fetch-"), name
    shown = {name: " ".join(sub.format_help().split()) for name, sub in commands.items()}
    for name in ("plan", "eval", "demo"):  # one default for every command that plans
        assert "(the paper) | uniform (default: calibrated)" in shown[name], name
        assert "| weight (the paper) (default: auto)" in shown[name], name


def test_a_model_directory_without_tokenizer_says_so(model_dir, capsys):
    assert main(["eval", "--model", model_dir]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert "not a model directory or .gguf file" in capsys.readouterr().err


def test_demo_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    """``lorc demo`` as README's main command runs it (default plan options), on a tiny
    local model instead of the embedded one, without the compiled speed test."""
    from helpers.tiny_llama import save_tiny_llama
    import lorc_fx.data.models as models

    directory = save_tiny_llama(tmp_path / "model")
    real_model, real_tokenizer = models.load_model, models.load_tokenizer
    monkeypatch.setattr(models, "load_model", lambda name: real_model(directory))
    monkeypatch.setattr(models, "load_tokenizer", lambda name: real_tokenizer(directory))
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "report"
    assert main(["demo", "--no-compile", "--tokens", "512", "--new-tokens", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("lorc demo: ") and "perplexity on news" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["perplexity"]["ppl_compressed"] > 0 and report["decode_speed"] == {}


def test_a_switch_option_is_a_flag_without_a_value():
    """``--codebook-tails`` turns ``PlanOptions.codebook_tails`` on; absent, the default."""
    from lorc_fx.cli import build_parser, plan_options

    parser = build_parser()
    on = parser.parse_args(["plan", "--bits-per-value", "2.56", "--codebook-tails"])
    off = parser.parse_args(["plan", "--bits-per-value", "2.56"])
    assert plan_options(on).codebook_tails and not plan_options(off).codebook_tails
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--codebook-tails", "no"])
