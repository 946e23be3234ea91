"""A plan on disk: one safetensors file that a later ``compress(model, plan=PATH)`` installs
without calibrating or planning again.

The file (``lorc_plan.safetensors`` by default; docs/design.md, "The plan file") holds

- tensors ``"{layer}.k_basis"``, ``"{layer}.v_basis"`` (latent rows ``P``, ``(rank, full)``,
  float64 as planned) and, for an oblique basis only, ``"{layer}.k_rebuild"`` /
  ``"{layer}.v_rebuild"`` (rebuild rows ``B``; an orthonormal basis rebuilds with ``P``);
  for a side stored as vector codes, its book's tables ``"{layer}.k_book.{run}.codewords"``
  and ``".values"``;
- one metadata entry, ``"lorc_fx.plan"``: JSON with the format version, the model's
  fingerprint (:func:`plan_fingerprint`) and name, the plan's scheme (``"kind"``), options,
  reachable range and RoPE angle log, and every :class:`LayerPlan` field that is not a
  tensor, each side's code as ``planner.code_json`` writes it.

The fingerprint hashes the model's config and a fixed sample of every weight, so a plan is
refused on another model, but not on the same weights loaded from another directory, onto
another device or in another floating-point dtype.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch import nn

from lorc_fx.analysis.records import AttentionBlock, RopeLayout
from lorc_fx.analysis.sharding import full_tensor, model_split

from lorc_fx.codes.integer import ChannelSplit, QuantSpec
from lorc_fx.codes.vector import VectorBook, VectorSpec

from .options import CalibrationOptions, PlanOptions
from .planner import (Code, LayerPlan, Plan, angle_log_width, code_json, latent_code,
                      process_plan, scale_dtype, value_token_group)
from .scheme import LOW_RANK, scheme_named

log = logging.getLogger(__name__)

PLAN_FILE = "lorc_plan.safetensors"  # the file name used when a path names a directory
FORMAT = "lorc_fx.plan"  # the metadata key, and the JSON's "format"
# bump when what the file holds changes (2: bits_per_value, dtype_bits, kind; 3: a plain plan
# stores values per token, KIVI's layout, where version 2 stored them per channel; 4: kind
# keys_waterfilled, whose layers record their key rows' code widths; 5: the RoPE angle log
# holds an angle per pair and a magnitude, ``rotary_dim / 2 + 1`` values a token, where up to
# version 4 it held ``cos`` and ``sin``, ``rotary_dim``: an older plan is read with the smaller
# log, its latents as planned; 6: each side's code in the layer, the scheme's name as "kind",
# vector plans with their books' tables)
VERSION = 6
_SAMPLES = 1024  # weight values hashed per tensor
# config keys that loading or saving changes (``save_pretrained`` fills in ``architectures``
# and ``dtype``); the parameters' names and shapes say which head the model has
_VOLATILE = {"transformers_version", "dtype", "torch_dtype", "use_cache", "architectures"}
_TENSORS = ("k_basis", "v_basis", "k_rebuild", "v_rebuild")
_CODES = ("k_code", "v_code")


class PlanFileError(ValueError):
    """A plan file that cannot be read, or that does not fit the model."""


def _stable(config):
    """The config without what loading or saving changes: where it came from (private ``_``
    keys, ``_name_or_path`` among them) and ``_VOLATILE``."""
    if isinstance(config, dict):
        return {k: _stable(v) for k, v in config.items()
                if not k.startswith("_") and k not in _VOLATILE}
    if isinstance(config, list):
        return [_stable(v) for v in config]
    return config


@torch.no_grad()
def plan_fingerprint(model: nn.Module) -> str:
    """A hash of the model's config (:func:`_stable`) and of every parameter's name, shape
    and ``_SAMPLES`` evenly spaced values rounded to bfloat16: the same for the same weights
    wherever they were loaded from, on any device, in any float dtype, whole or split over
    tensor-parallel processes (then a collective: every process calls it).

    (``calibration.model_fingerprint`` keys on-disk caches and hashes the path the model was
    loaded from and float sums that differ across devices; for a file meant to move between
    machines this one is used instead.)"""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(json.dumps(_stable(json.loads(config.to_json_string(use_diff=False))),
                            sort_keys=True).encode())
    for name, p in model.named_parameters():  # a tensor-parallel model's whole weights
        flat = full_tensor(p.detach()).reshape(-1)
        n = flat.numel()
        k = min(n, _SAMPLES)
        index = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
        values = flat[index.to(flat.device)].to(torch.bfloat16).cpu().view(torch.int16)
        h.update(f"{name}|{tuple(p.shape)}|".encode())
        h.update(values.numpy().tobytes())
    return h.hexdigest()[:16]


def model_name(model: nn.Module) -> str:
    """The model's class and where it was loaded from, for messages."""
    source = getattr(model, "name_or_path", "") or getattr(
        getattr(model, "config", None), "_name_or_path", "")
    return type(model).__name__ + (f" ({source})" if source else "")


def plan_path(path: str | os.PathLike) -> Path:
    """``path``, or ``PLAN_FILE`` inside it where it names a directory."""
    path = Path(path).expanduser()
    return path / PLAN_FILE if path.is_dir() else path


def _layer_json(layer: LayerPlan) -> dict:
    out = {f.name: getattr(layer, f.name) for f in fields(LayerPlan)
           if f.name not in (*_TENSORS, *_CODES)}
    out["rope"] = asdict(layer.rope)
    out["k_oblique"] = not torch.equal(layer.k_rebuild, layer.k_basis)
    out["v_oblique"] = not torch.equal(layer.v_rebuild, layer.v_basis)
    out.update(k_code=code_json(layer.k_code), v_code=code_json(layer.v_code))
    return out


def _plan_json(plan: Plan) -> dict:
    return {"format": FORMAT, "version": VERSION, "fingerprint": plan.fingerprint,
            "model": plan.model_name, "cache_fraction": plan.cache_fraction,
            "options": asdict(plan.options), "reachable": list(plan.reachable),
            "rotary_log": plan.rotary_log, "basis_note": plan.basis_note,
            "fraction_search": plan.fraction_search,
            "dtype_bits": plan.dtype_bits, "kind": plan.scheme.name,
            "candidates": plan.candidates, "layers": [_layer_json(l) for l in plan.layers]}


def _book_tensors(name: str, code: Code) -> dict[str, torch.Tensor]:
    if not isinstance(code, VectorBook):
        return {}
    return {f"{name}.{i}.{part}": t.detach().cpu().contiguous().clone()
            for i, tables in enumerate(code.tables)
            for part, t in zip(("codewords", "values"), tables)}


def _plan_tensors(plan: Plan) -> dict[str, torch.Tensor]:
    """Every tensor a plan file holds, by name: bases, oblique rebuild rows, vector books."""
    tensors = {}
    for layer in plan.layers:
        for side in ("k", "v"):
            basis = getattr(layer, f"{side}_basis")
            tensors[f"{layer.layer}.{side}_basis"] = basis.detach().cpu().contiguous().clone()
            rebuild = getattr(layer, f"{side}_rebuild")
            if not torch.equal(rebuild, basis):
                tensors[f"{layer.layer}.{side}_rebuild"] = rebuild.detach().cpu().contiguous().clone()
            tensors.update(_book_tensors(f"{layer.layer}.{side}_book",
                                         getattr(layer, f"{side}_code")))
    return tensors


def plan_digest(plan: Plan) -> str:
    """A hash of everything a file of ``plan`` would hold (its tensors' bytes and its
    description): equal for plans that would save alike, a key for what is measured of one."""
    h = hashlib.sha256(json.dumps(_plan_json(plan), sort_keys=True).encode())
    for name, tensor in sorted(_plan_tensors(plan).items()):
        h.update(name.encode())
        h.update(str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()[:20]


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write ``plan`` to ``path`` (a file, or a directory to hold ``PLAN_FILE``); returns the
    file written, and logs it once at INFO. The plan must record its model's fingerprint,
    as every plan of ``lorc_fx.plan``/``compress`` does."""
    if plan.shard is not None:
        raise ValueError(f"this is the plan of shard {plan.shard} of {plan.options.shards} only; "
                         "save the whole model's plan (lorc_fx.save_plan(model) or report.save)")
    if plan.fingerprint is None:
        raise ValueError("this plan records no model fingerprint, so a file of it could not "
                         "be checked against a model; save the plan of lorc_fx.plan(model) or "
                         "of a model lorc_fx.compress compressed")
    path = plan_path(path)
    from safetensors.torch import save

    data = save(_plan_tensors(plan), metadata={FORMAT: json.dumps(_plan_json(plan))})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # renamed once whole
    try:
        tmp.write_bytes(data)  # (safetensors' save_file would make it owner-only)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    log.info("wrote LoRC plan of %d layers (cache fraction %.4f, %s) to %s", len(plan.layers),
             plan.cache_fraction, plan.model_name or "model " + plan.fingerprint, path)
    return path


def _options(data: dict) -> PlanOptions:
    calibration = dict(data.pop("calibration"))
    calibration["texts"] = tuple(calibration["texts"])
    if data.get("bits_per_value") is not None:  # up to version 5 both were always set
        data["cache_fraction"] = None
    data.setdefault("retrieval_weight", 1.0)  # plans before it weighed no layer up
    data.setdefault("answer_weight", 0.0)  # plans before it weighed no channel by answers
    data.setdefault("drift_chunk", 0)  # plans before it coded no drift
    data.setdefault("recent_divisor", 0)  # plans before it kept no recent window
    return PlanOptions(**data, calibration=CalibrationOptions(**calibration))


def _tensor(f, name: str, shape: tuple[int, int] | None, source: Path) -> torch.Tensor:
    """The floating-point tensor ``name`` (of ``shape``, where given)."""
    if name not in f.keys():
        raise PlanFileError(f"plan file {source} lacks the tensor {name!r}")
    t = f.get_tensor(name)
    if (shape is not None and tuple(t.shape) != shape) or not t.is_floating_point():
        raise PlanFileError(f"plan file {source}: tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                            f"the plan says a floating-point {shape}")
    return t


def _code(f, name: str, data: dict | None, dtype_bits: int, source: Path) -> Code:
    """The code ``code_json`` wrote (a vector book's tables read from ``name``'s tensors)."""
    if data is None:
        return None
    scales = scale_dtype(dtype_bits)
    if "vector_runs" in data:
        spec = VectorSpec(tuple((c, b) for c, b in data["vector_runs"]), data["tuple_dims"])
        tables = tuple((_tensor(f, f"{name}.{i}.codewords", None, source),
                        _tensor(f, f"{name}.{i}.values", None, source))
                       for i in range(len(spec.runs)))
        return VectorBook(spec, tables, data.get("drift_chunk", 0),  # none before them
                          data.get("recent_divisor", 0))
    if "bit_runs" in data:
        return ChannelSplit(tuple((c, b) for c, b in data["bit_runs"]), data["group"], scales)
    return QuantSpec(data["bits"], data["group"], data["axis"], scales)


def _codes_before_6(data: dict, kind: str, options: PlanOptions, dtype_bits: int
                    ) -> tuple[Code, Code]:
    """A layer's codes in a file of version 5 or older, which said them by the plan's kind,
    its options and the key rows' widths (``k_bit_runs``, ``k_group``)."""
    if data["skipped"]:
        return None, None
    options, scales = options.concrete(), scale_dtype(dtype_bits)
    bits, group = options.latent_bits, options.latent_group
    values = QuantSpec.per_token(bits, value_token_group(data["head_dim"], group), scales)
    if kind == "plain":
        return QuantSpec.per_channel(bits, group, scales), values
    if kind == "keys_waterfilled":
        runs = tuple(tuple(run) for run in data.get("k_bit_runs", ()))
        return (ChannelSplit(runs, data["k_group"], scales) if runs else None,
                values if data["v_compressible"] else None)
    return (latent_code(options, dtype_bits, data["k_compressible"], data["k_rank"]),
            latent_code(options, dtype_bits, data["v_compressible"], data["v_rank"]))


def _layer(f, data: dict, plan: dict, options: PlanOptions, source: Path) -> LayerPlan:
    data = dict(data)
    oblique = {side: data.pop(f"{side}_oblique") for side in ("k", "v")}
    data["rope"] = RopeLayout(**data["rope"])
    dtype_bits = plan.get("dtype_bits", 16)
    if plan["version"] < 6:
        codes = _codes_before_6(data, plan.get("kind", LOW_RANK), options, dtype_bits)
        data.pop("k_bit_runs", None), data.pop("k_group", None)
    else:
        codes = tuple(_code(f, f"{data['layer']}.{side}_book", data[f"{side}_code"], dtype_bits,
                            source) for side in ("k", "v"))
    data["k_code"], data["v_code"] = codes
    for side, code in zip(("k", "v"), codes):
        width = code.width if isinstance(code, ChannelSplit) else \
            code.spec.width if isinstance(code, VectorBook) else None
        if width not in (None, data[f"{side}_rank"]):
            raise PlanFileError(f"plan file {source}: layer {data['layer']}'s {side} code "
                                f"covers {width} rows of {data[f'{side}_rank']}")
    for side in ("k", "v"):
        shape = (data[f"{side}_rank"], data[f"{side}_full"])
        basis = _tensor(f, f"{data['layer']}.{side}_basis", shape, source)
        data[f"{side}_basis"] = basis
        data[f"{side}_rebuild"] = (_tensor(f, f"{data['layer']}.{side}_rebuild", shape, source)
                                   if oblique[side] else basis)
    return LayerPlan(**data)


def load_plan(path: str | os.PathLike) -> Plan:
    """The plan saved at ``path`` (a file, or a directory holding ``PLAN_FILE``). Raises
    ``FileNotFoundError`` where there is none and :class:`PlanFileError` (a ``ValueError``)
    where the file is not a plan this version reads; both name the file."""
    source = plan_path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no LoRC plan file at {source}"
                                + (f" (looked for {PLAN_FILE} in the directory)"
                                   if source.name == PLAN_FILE and source.parent.is_dir() else ""))
    from safetensors import safe_open

    try:
        with safe_open(str(source), framework="pt") as f:
            text = (f.metadata() or {}).get(FORMAT)
            if text is None:
                raise PlanFileError(f"{source} is a safetensors file but not a LoRC plan "
                                    f"(no {FORMAT!r} metadata)")
            data = json.loads(text)
            if data.get("format") != FORMAT or not isinstance(data.get("version"), int):
                raise PlanFileError(f"{source} is not a LoRC plan file")
            if data["version"] > VERSION:
                raise PlanFileError(f"plan file {source} has format version {data['version']}; "
                                    f"this lorc_fx reads up to {VERSION}: update lorc_fx")
            if data["version"] < 3 and data.get("kind") == "plain":
                raise PlanFileError(f"plan file {source} is a plain quantization plan of format "
                                    f"version {data['version']}, whose values were quantized "
                                    "per channel; plan again (values are now quantized per "
                                    "token)")
            options = _options(data["options"])
            layers = [_layer(f, l, data, options, source) for l in data["layers"]]
            rotary_log = data["rotary_log"]
            if data["version"] < 5 and rotary_log:  # it was the rotary dims (cos and sin)
                rotary_log = angle_log_width(rotary_log)
            plan = Plan(layers, options, tuple(data["reachable"]), rotary_log,
                        basis_note=data.get("basis_note", ""),
                        fraction_search=data.get("fraction_search"),
                        fingerprint=data["fingerprint"], model_name=data.get("model"),
                        dtype_bits=data.get("dtype_bits", 16),
                        scheme=scheme_named(data.get("kind", LOW_RANK)),
                        candidates=data.get("candidates", []))
    except PlanFileError:
        raise
    except Exception as err:  # safetensors' own error, bad JSON, missing or mistyped fields
        raise PlanFileError(f"cannot read the LoRC plan file {source}: it is corrupt or not a "
                            f"plan file ({type(err).__name__}: {err})") from err
    return plan


def check_fits(plan: Plan, model: nn.Module, blocks: list[AttentionBlock],
               source: str | os.PathLike = "the plan") -> None:
    """Refuse (:class:`PlanFileError`, naming ``source``) a plan made for another model, or
    whose layers are not the model's attention blocks as this analysis finds them (on a
    tensor-parallel process: this process's shard of them)."""
    fingerprint = plan_fingerprint(model)
    if plan.fingerprint is not None and plan.fingerprint != fingerprint:
        made_for = plan.model_name or "another model"
        raise PlanFileError(
            f"{source} is a plan for {made_for} (fingerprint {plan.fingerprint}), not for this "
            f"{model_name(model)} (fingerprint {fingerprint}): the config or weights differ. "
            f"Plan this model instead: lorc_fx.compress(model, cache_fraction)")
    split = model_split(blocks)
    if split is not None and split.count != plan.options.shards:
        raise PlanFileError(f"{source} is a plan over {plan.options.shards} shard(s) of the KV "
                            f"heads, but this model is split over {split.count} tensor-parallel "
                            "processes; plan it as it is loaded")
    plan = process_plan(plan, blocks)
    supported = {b.layer: b for b in blocks if b.supported}
    planned = [l.layer for l in plan.layers]
    if sorted(planned) != sorted(supported):
        raise PlanFileError(f"{source} plans attention layers {planned}, but the analysis of "
                            f"this model finds {sorted(supported)}")
    for l in plan.layers:
        b = supported[l.layer]
        found = dict(num_heads=b.num_heads, num_kv_heads=b.num_kv_heads, head_dim=b.head_dim,
                     rope=b.rope_k, k_full=b.k.width, v_full=b.v.width)
        differ = {k: (getattr(l, k), v) for k, v in found.items() if getattr(l, k) != v}
        # a side the plan keeps raw fits (a sliding-window layer's, in a low-rank or vector
        # plan); one it compresses must be compressible here (a data-aware basis covers
        # normed keys)
        if l.k_compressible and b.k_path not in ("none", "rope", "norm"):
            differ["k_compressible"] = (True, False)
        if l.v_compressible and b.v_path != "none":
            differ["v_compressible"] = (True, False)
        if differ:
            detail = ", ".join(f"{k} {p} in the plan, {m} in the model"
                               for k, (p, m) in differ.items())
            raise PlanFileError(f"{source}: layer {l.layer} does not fit this model: {detail}")
