"""Decode-step attention + output projection over a latent cache, three ways, on CPU.

    OMP_NUM_THREADS=1 python bench/absorbed_attention.py

- ``reconstruct``: rebuild K/V (``c @ P``) and run SDPA (what the eager latent cache does);
- ``absorbed``: query through ``P_k`` blocks, MQA over the latent, per-head ``P_v`` expansion
  (what ``lorc_backend`` emits);
- ``folded``: as ``absorbed`` but ``P_v`` folded into the output projection
  (``W_o · blockdiag(P_v blocks)``, computed once ahead);
- ``manual``: eager attention with a softcap (Gemma 2's ``tanh`` on the scores) over the
  rebuilt K/V, each KV head repeated per query head as transformers' ``repeat_kv`` does;
- ``manual_absorbed``: the same with both products read from the latents (``latent_scores``,
  ``latent_sums``: what ``lorc_backend`` emits for manual attention), the softcap between.

Each is compiled with Inductor; times are medians over repeated calls, as ratios to
``reconstruct`` measured in the same run. Shapes: the default model's layer (9 query heads,
3 KV heads, head dim 64, hidden 576).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lorc_fx.compile.latent_attention import (head_blocks, latent_attention,  # noqa: E402
                                              latent_scores, latent_sums)
from lorc_fx.cache.latent_ops import reconstruct_math  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576
RESULTS = Path(__file__).resolve().parent / "results"


def reconstruct_variant(q, c_k, c_v, p_k, p_v, w_o, w_fold):
    k, v = reconstruct_math(c_k, p_k, KV_HEADS), reconstruct_math(c_v, p_v, KV_HEADS)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) @ w_o.t()


def absorbed_variant(q, c_k, c_v, p_k, p_v, w_o, w_fold):
    out = latent_attention(q, c_k, c_v, p_k, p_v, KV_HEADS, use_kernel=False)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) @ w_o.t()


def folded_variant(q, c_k, c_v, p_k, p_v, w_o, w_fold):
    q_latent = torch.einsum("bhtd,hrd->bhtr", q, head_blocks(p_k, KV_HEADS, HEADS))
    out = F.scaled_dot_product_attention(q_latent, c_k, c_v, enable_gqa=True,
                                         scale=HEAD_DIM ** -0.5)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) @ w_fold.t()


SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def softcapped_probs(scores):
    return torch.softmax(torch.tanh(scores * HEAD_DIM ** -0.5 / SOFTCAP) * SOFTCAP, dim=-1)


def manual_variant(q, c_k, c_v, p_k, p_v, w_o, w_fold):
    rep = HEADS // KV_HEADS
    k, v = (reconstruct_math(c, p, KV_HEADS).repeat_interleave(rep, dim=1)
            for c, p in ((c_k, p_k), (c_v, p_v)))
    out = softcapped_probs(q @ k.transpose(2, 3)) @ v
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) @ w_o.t()


def manual_absorbed_variant(q, c_k, c_v, p_k, p_v, w_o, w_fold):
    probs = softcapped_probs(latent_scores(q, c_k, p_k, KV_HEADS))
    out = latent_sums(probs, c_v, p_v, KV_HEADS)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) @ w_o.t()


def fold_output(w_o: torch.Tensor, p_v: torch.Tensor) -> torch.Tensor:
    """``W_o (D, h*d)`` · blockdiag over query heads of ``P_vᵀ`` blocks → ``(D, h*r)``."""
    blocks = head_blocks(p_v, KV_HEADS, HEADS)  # (h, r, d)
    return torch.einsum("ehd,hrd->ehr", w_o.view(HIDDEN, HEADS, HEAD_DIM), blocks).reshape(HIDDEN, -1)


def median_ms(fn, args, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    variants = {"reconstruct": reconstruct_variant, "absorbed": absorbed_variant,
                "folded": folded_variant, "manual": manual_variant,
                "manual_absorbed": manual_absorbed_variant}
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in variants.items()}
    for n in (512, 2048):
        for fraction in (1.0, 0.5, 0.25):
            r = int(fraction * KV_HEADS * HEAD_DIM)
            basis = lambda: torch.linalg.qr(torch.randn(KV_HEADS * HEAD_DIM, r, generator=gen)).Q.T.contiguous()
            p_k, p_v = basis(), basis()
            w_o = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen) * 0.05
            args = (torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen),
                    torch.randn(1, 1, n, r, generator=gen), torch.randn(1, 1, n, r, generator=gen),
                    p_k, p_v, w_o, fold_output(w_o, p_v))
            expected = {name: (manual_variant if name.startswith("manual") else
                               reconstruct_variant)(*args) for name in variants}
            row = {"context": n, "fraction": fraction, "rank": r}
            for name, fn in compiled.items():
                torch.testing.assert_close(fn(*args), expected[name], atol=1e-3, rtol=1e-3)
                row[f"{name}_ms"] = median_ms(fn, args, 200)
            row["absorbed/reconstruct"] = row["absorbed_ms"] / row["reconstruct_ms"]
            row["folded/reconstruct"] = row["folded_ms"] / row["reconstruct_ms"]
            row["manual_absorbed/manual"] = row["manual_absorbed_ms"] / row["manual_ms"]
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "absorbed_attention-cpu.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    lines = [f"Decode attention + o_proj, one token, batch 1, CPU ({machine}); medians of 200 calls.", "",
             "| context | fraction | rank | reconstruct ms | absorbed ms | folded ms | absorbed/reconstruct | folded/reconstruct "
             "| manual (softcap) ms | manual absorbed ms | manual absorbed/manual |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['fraction']} | {r['rank']} | {r['reconstruct_ms']:.3f} | {r['absorbed_ms']:.3f} | "
              f"{r['folded_ms']:.3f} | {r['absorbed/reconstruct']:.2f} | {r['folded/reconstruct']:.2f} | "
              f"{r['manual_ms']:.3f} | {r['manual_absorbed_ms']:.3f} | {r['manual_absorbed/manual']:.2f} |"
              for r in rows]
    (RESULTS / "absorbed_attention-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
