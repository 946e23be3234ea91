"""4-bit KV-cache quantization variants vs the KIVI-style baseline (issue #13's 4.5-bit
point): an exploration, not wired into the planner. Results and the reading of them:
bench/results/int4_variants-cpu.md.

    OMP_NUM_THREADS=1 python bench/int4_variants.py --variants base,vhad,... \
        [--sets self_held,self_calib,news,austen,poems] [--tokens 4096]

Variants are chosen on text the model sampled itself (``self_held``: the planner's held-out
windows; ``self_calib``: the calibration sample), never on the evaluation texts.

A fake-quantizing cache (``VarLayer``, a DynamicLayer like bench/kv_quant_baseline.KiviLayer,
residual 0) with per-layer options:
  kbits/kgroup   keys per channel over groups of kgroup tokens
  kpre           keys quantized BEFORE RoPE: the cache un-rotates the post-RoPE key with the
                 layer's own cos/sin (captured by a forward pre-hook on self_attn), quantizes,
                 re-rotates the dequantized key (RoPE is orthogonal, so this is exactly
                 "quantize pre-RoPE, apply RoPE after dequantization")
  vbits/vgroup   values per token over groups of vgroup channels
  vhad           values rotated by an orthonormal 64x64 Hadamard H before quantization and
                 rotated back after (== folding H into v_proj / Hᵀ into o_proj)
  sink           the first `sink` tokens of the sequence kept at 16 bits (codes start after)
  vizero         values' zero points stored as `bits`-bit integers (the code of 0.0, each
                 group's range widened to hold 0; a value group nearly always does), 16-bit
                 scale: a group costs 16 + bits bits of metadata instead of 32. Keys keep
                 float zero points (pre-RoPE key channels sit far from 0)
  vnf4           values as 4-bit NormalFloat codes (levels at normal quantiles, as QLoRA's
                 NF4), symmetric: one 16-bit absmax scale per group, no zero point
Every token is quantized (a partial last group is quantized too, padded, and its bytes counted).
Bits are counted from the quantized tensors' nbytes (16-bit scale + zero), 16-bit sink tokens,
plus the RoPE angle log (64 16-bit values per token, shared over all layers/heads/sides) when
any layer quantizes keys pre-RoPE.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import os
import sys
import time
from dataclasses import dataclass, replace, asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import lorc_fx  # noqa: E402
from lorc_fx.cache.quantize import QuantSpec, _grouped, fake_quantize, round_to  # noqa: E402
from lorc_fx.eval.evaluate import evaluation_windows  # noqa: E402

SCALE = torch.float16
OUT = Path(__file__).parent / "results" / "int4_variants-cpu.jsonl"


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Side:
    kbits: int = 4
    kgroup: int = 64
    kpre: bool = False
    vbits: int = 4
    vgroup: int = 64
    vhad: bool = False
    vizero: bool = False
    vnf4: bool = False


class Ctx:
    cos = {}
    sin = {}


def fq(x, spec, integer_zero=False, normal_float=False):
    """fake-quantize, bytes"""
    if spec.bits == 16:
        return x, x.numel() * 2
    if normal_float:
        return fq_normal_float(x, spec)
    if integer_zero:
        return fq_integer_zero(x, spec)
    return fake_quantize(x, spec)


def _ungrouped(g, like, spec):
    """``g (..., groups, group)``, as ``_grouped(like, spec)`` made it, back to ``like``'s
    shape and dtype (the last group's padding cut off)."""
    n = like.shape[spec.axis]
    return g.flatten(-2)[..., :n].to(like.dtype).movedim(-1, spec.axis)


def fq_integer_zero(x, spec):
    """fake-quantize with the zero point an integer code: each group's range widened to
    hold 0, scale rounded up to fp16; bytes"""
    levels = (1 << spec.bits) - 1
    g = _grouped(x, spec).float()
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = round_to((hi - lo) / levels, SCALE, up=True).clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp(0, levels)
    codes = (torch.round(g / scale) + zero).clamp(0, levels)
    groups = g.shape[:-1].numel()
    return (_ungrouped((codes - zero) * scale, x, spec),
            groups * (spec.group * spec.bits // 8 + 2) + math.ceil(groups * spec.bits / 8))


def normal_float_levels() -> torch.Tensor:
    """16 levels in [-1, 1] at quantiles of a standard normal: 0, 8 positive, 7 negative."""
    icdf = torch.distributions.Normal(0.0, 1.0).icdf
    positive = icdf(torch.linspace(0.5, 0.9677, 9))[1:]
    negative = -icdf(torch.linspace(0.5, 0.9677, 8))[1:]
    levels = torch.cat([negative, torch.zeros(1), positive]).sort().values
    return levels / levels.abs().max()


def fq_normal_float(x, spec):
    """fake-quantize to 4-bit NormalFloat, one fp16 absmax scale per group; bytes"""
    assert spec.bits == 4
    levels = normal_float_levels().to(x.device)
    g = _grouped(x, spec).float()
    scale = round_to(g.abs().amax(-1, keepdim=True), SCALE, up=True).clamp_min(1e-8)
    codes = ((g / scale)[..., None] - levels).abs().argmin(-1)
    groups = g.shape[:-1].numel()
    return _ungrouped(levels[codes] * scale, x, spec), groups * (spec.group * spec.bits // 8 + 2)


class VarLayer(DynamicLayer):
    def __init__(self, idx, cfg: Side, sink: int):
        super().__init__()
        self.idx, self.cfg, self.sink = idx, cfg, sink
        self.bytes = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys.numel() == 0, "single-forward scoring only"
        c, s = self.cfg, self.sink
        n = key_states.shape[-2]
        k, v = key_states, value_states
        kq, vq = k[..., s:, :], v[..., s:, :]
        if c.kpre:
            cos = Ctx.cos[self.idx][:, None, s:, :].to(k.dtype)
            sin = Ctx.sin[self.idx][:, None, s:, :].to(k.dtype)
            pre = kq * cos - rotate_half(kq) * sin
            deq, kb = fq(pre, QuantSpec.per_channel(c.kbits, c.kgroup, SCALE))
            kd = deq * cos + rotate_half(deq) * sin
        else:
            kd, kb = fq(kq, QuantSpec.per_channel(c.kbits, c.kgroup, SCALE))
        if c.vhad:
            H = hadamard(v.shape[-1]).to(v.dtype)
            deq, vb = fq(vq @ H, QuantSpec.per_token(c.vbits, c.vgroup, SCALE), c.vizero, c.vnf4)
            vd = deq @ H.T
        else:
            vd, vb = fq(vq, QuantSpec.per_token(c.vbits, c.vgroup, SCALE), c.vizero, c.vnf4)
        keys = torch.cat([k[..., :s, :], kd], dim=-2)
        values = torch.cat([v[..., :s, :], vd], dim=-2)
        self.bytes = kb + vb + 2 * 2 * k[..., :s, :].numel()
        self.full = 2 * (k.numel() + v.numel())
        self.keys, self.values = keys, values
        return keys, values


class VarCache(Cache):
    def __init__(self, cfgs, sink):
        super().__init__(layers=[VarLayer(i, c, sink) for i, c in enumerate(cfgs)])

    def bits(self, angle_log_tokens_bits=0.0):
        b = sum(l.bytes for l in self.layers) * 8
        full_vals = sum(l.full for l in self.layers) / 2
        return b / full_vals


def install_hooks(model):
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(mod, args, kwargs, i=i):
            cos, sin = kwargs["position_embeddings"]
            Ctx.cos[i], Ctx.sin[i] = cos, sin
        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


@torch.no_grad()
def score(model, windows, cfgs, sink, batch_size=2):
    """mean loss (nats), measured bits/value (with angle log if any kpre), losses per window"""
    total, count, per = 0.0, 0, []
    bits = []
    for batch in windows.split(batch_size):
        if cfgs is None:
            logits = model(batch, use_cache=False).logits
        else:
            cache = VarCache(cfgs, sink)
            logits = model(batch, past_key_values=cache, use_cache=True).logits
            bits.append(cache.bits())
        logits = logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        per += ce.mean(1).tolist()
        total += float(ce.sum())
        count += ce.numel()
    b = sum(bits) / len(bits) if bits else 16.0
    if cfgs is not None and any(c.kpre for c in cfgs):
        L = len(cfgs)
        kvh, hd = model.config.num_key_value_heads, model.config.head_dim
        b += 64 * 16 / (L * kvh * 2 * hd)
    return total / count, b, per


def variant(name, L=30):
    """name -> (per-layer Side list, sink). Syntax: tokens joined by '+':
    base | vhad | kpre | vizero | vnf4 | k128 | v32 | sink1 | k<bits>:<layers> | v<bits>:<layers> | kg<N> | vg<N>
    (bits 2, 3, 4, 8 or 16; layers like 1.4.10-29)"""
    side, sink, over = Side(), 0, {}
    for t in name.split("+"):
        if t == "base":
            pass
        elif t == "vhad":
            side = replace(side, vhad=True)
        elif t == "vnf4":
            side = replace(side, vnf4=True)
        elif t == "vizero":
            side = replace(side, vizero=True)
        elif t == "kpre":
            side = replace(side, kpre=True)
        elif t.startswith("kg"):
            side = replace(side, kgroup=int(t[2:]))
        elif t.startswith("vg"):
            side = replace(side, vgroup=int(t[2:]))
        elif t.startswith("sink"):
            sink = int(t[4:])
        elif t == "all16":
            side = replace(side, kbits=16, vbits=16)
        elif re.fullmatch(r"(k|v|kv)(2|3|4|8|16):[0-9.\-]+", t):
            what, layers = t.split(":")
            for part in layers.split("."):
                first, _, last = part.partition("-")
                for l in range(int(first), int(last or first) + 1):
                    over.setdefault(l, []).append(what)
        else:
            raise ValueError(t)
    cfgs = []
    for i in range(L):
        c = side
        for w in over.get(i, []):
            b = int(w.lstrip("kv"))
            if "k" in w:
                c = replace(c, kbits=b)
            if "v" in w:
                c = replace(c, vbits=b)
        cfgs.append(c)
    return cfgs, sink


def self_sets(model):
    from lorc_fx.plan.calibration import self_generated_windows
    from lorc_fx.plan.options import PlanOptions
    from lorc_fx.search.split import held_out_windows
    held = held_out_windows(model, PlanOptions())        # the planner's held-out: seed 1, 8x256
    calib = self_generated_windows(model, None, 32, 256, 0)  # calibration text: seed 0, 32x256
    return {"self_held": held, "self_calib": calib}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base")
    ap.add_argument("--sets", default="self_held,self_calib")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--limit", type=int, default=0, help="only the first N windows per set")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = lorc_fx.load_model("default")
    tok = lorc_fx.load_tokenizer("default")
    install_hooks(model)
    sets = {}
    names = args.sets.split(",")
    if any(n.startswith("self") for n in names):
        ss = self_sets(model)
        sets.update({n: ss[n] for n in names if n in ss})
    for n in names:
        if not n.startswith("self"):
            sets[n] = evaluation_windows(tok, lorc_fx.load_text(n), args.tokens, args.window)
    if args.limit:
        sets = {k: v[: args.limit] for k, v in sets.items()}
    # full-model losses, cached
    fullf = OUT.with_name("int4_variants_full-cpu.json")
    full = json.loads(fullf.read_text()) if fullf.exists() else {}
    for n, w in sets.items():
        key = f"{n}:{tuple(w.shape)}"
        if key not in full:
            t = time.time()
            loss, _, per = score(model, w, None, 0)
            full[key] = {"loss": loss, "per": per, "seconds": time.time() - t}
            fullf.write_text(json.dumps(full))
            print(f"full {key}: loss {loss:.4f} ppl {math.exp(loss):.3f} ({time.time() - t:.0f}s)", flush=True)
    for v in args.variants.split(","):
        cfgs, sink = variant(v)
        for n, w in sets.items():
            key = f"{n}:{tuple(w.shape)}"
            t = time.time()
            loss, bits, per = score(model, w, cfgs, sink)
            sec = time.time() - t
            d = loss - full[key]["loss"]
            dper = [a - b for a, b in zip(per, full[key]["per"])]
            m = sum(dper) / len(dper)
            se = (sum((x - m) ** 2 for x in dper) / (len(dper) - 1) / len(dper)) ** 0.5 if len(dper) > 1 else float("nan")
            rec = {"variant": v, "set": key, "loss": loss, "dloss": d, "ratio": math.exp(d),
                   "bits": bits, "seconds": sec, "dper": dper, "se_dloss": se, "tag": args.tag}
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{v:40s} {key:22s} bits {bits:.4f} dloss {d:+.5f} (se {se:.5f}) ratio x{math.exp(d):.4f} {sec:.0f}s", flush=True)


if __name__ == "__main__":
    main()
