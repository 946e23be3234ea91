"""What the GPU suite checks on CUDA beyond tests/kernels: the code-reading decode attention as
Inductor compiles it for CUDA, and compiled ``generate`` over each cache scheme.

Run by bench/gpu/suite.py (not collected by the project's test command: it lives outside
``tests``). On a GPU everything runs on CUDA through Inductor. With ``LORC_GPU_SMOKE=1`` (the
suite's ``--cpu-smoke``) the same cases run on a CPU at the same toy sizes, float32 only,
traced but not compiled (``lorc_backend``'s passes alone): their code is checked, not CUDA's.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from lorc_fx.codes.integer import QuantSpec, dequantize, quantize
from lorc_fx.compile.quantized_attention import (quantized_kv_attention,
                                                 quantized_latent_attention)

SMOKE = os.environ.get("LORC_GPU_SMOKE") == "1"
if not SMOKE and not torch.cuda.is_available():
    pytest.skip("no GPU (LORC_GPU_SMOKE=1 runs these on a CPU)", allow_module_level=True)
DEVICE = torch.device("cpu" if SMOKE else "cuda")
DTYPES = [torch.float32] if SMOKE else [torch.float16, torch.bfloat16, torch.float32]
# relative error against float64 maths over the dequantized codes
RTOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def compiled(fn, inputs):
    """``fn(*inputs)`` traced and, on a GPU, compiled by Inductor as ``lorc_backend`` compiles
    the function it puts in place of SDPA."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn)(*inputs)
    if SMOKE:
        return lambda: gm(*inputs)
    from torch._inductor.compile_fx import compile_fx

    run = compile_fx(gm, inputs)
    return lambda: run(*inputs)


def coded(x, spec):
    q = quantize(x, spec)
    axis = -2 if spec.axis % 4 == 2 else -1
    codes = (q.payload.contiguous(), q.scale.contiguous(), q.zero.contiguous(), spec.bits,
             spec.group, axis, x.shape[2], x.shape[3], x.dtype)
    return (codes, None, None), dequantize(q).double()


def padding_mask(batch: int, n: int) -> torch.Tensor:
    """SDPA's boolean ``(b, 1, 1, n)``: row 1 left-padded by 7 tokens."""
    mask = torch.ones(batch, 1, 1, n, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :7] = False
    return mask


CODE_CASES = [  # scheme, bits, (query heads, KV heads), rank of a latent side
    ("plain", 8, (32, 8), None), ("plain", 4, (8, 1), None),
    ("latent", 8, (8, 1), 37), ("latent", 4, (32, 8), 45),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CODE_CASES, ids=str)
def test_code_reading_attention_equals_sdpa_over_the_dequantized_cache(case, dtype):
    """GQA and MQA, a padding mask, 300 tokens (no whole number of groups), odd latent
    ranks: compiled, the functions equal float64 SDPA over the same codes dequantized."""
    scheme, bits, (heads, kv_heads), rank = case
    gen = torch.Generator(DEVICE).manual_seed(bits)
    batch, n, d = 2, 300, 64
    randn = lambda *s: torch.randn(*s, generator=gen, device=DEVICE).to(dtype)  # noqa: E731
    scale_dtype = dtype if dtype.itemsize == 2 else torch.float16
    q, mask = randn(batch, heads, 1, d), padding_mask(batch, n)
    if scheme == "plain":
        (k_side, keys), (v_side, values) = (
            coded(randn(batch, kv_heads, n, d), QuantSpec.per_channel(bits, 64, scale_dtype)),
            coded(randn(batch, kv_heads, n, d), QuantSpec.per_token(bits, 64, scale_dtype)))
        fn = lambda q, mask, *t: quantized_kv_attention(  # noqa: E731
            q, ((*t[:3], *k_side[0][3:]), None, None), ((*t[3:], *v_side[0][3:]), None, None),
            attn_mask=mask, scale=0.125)
    else:
        spec = QuantSpec.per_channel(bits, 32, scale_dtype)
        (k_side, k_latent), (v_side, v_latent) = (coded(randn(batch, 1, n, rank), spec)
                                                  for _ in "kv")
        bases = [torch.linalg.qr(torch.randn(kv_heads * d, rank, generator=gen, device=DEVICE,
                                             dtype=torch.float64)).Q.T for _ in "kv"]
        keys, values = (torch.einsum("bxnr,rhd->bhnd", c, p.view(rank, kv_heads, d))
                        for c, p in zip((k_latent, v_latent), bases))
        fn = lambda q, mask, *t: quantized_latent_attention(  # noqa: E731
            q, ((*t[:3], *k_side[0][3:]), None, None), ((*t[3:], *v_side[0][3:]), None, None),
            *(p.to(dtype) for p in bases), kv_heads, attn_mask=mask, scale=0.125)
    inputs = [q, mask, *k_side[0][:3], *v_side[0][:3]]
    got = compiled(fn, inputs)()
    got = got[0] if isinstance(got, (list, tuple)) else got
    expected = F.scaled_dot_product_attention(q.double(), keys, values, attn_mask=mask,
                                              scale=0.125, enable_gqa=True)
    err = ((got.double() - expected).norm() / expected.norm()).item()
    assert got.dtype == dtype and err < RTOL[dtype], err


GENERATE_CASES = [  # name, compress options, dtype
    ("int8", dict(bits_per_value=9.0), torch.float32),
    ("latent4", dict(bits_per_value=2.56, latent_bits=4, basis="weight", schedule="uniform",
                     rope="commute"), torch.float32),
    ("latent16", dict(cache_fraction=0.5, latent_bits=16, basis="weight", schedule="uniform",
                      rope="commute"), torch.float32),
    ("latent16", dict(cache_fraction=0.5, latent_bits=16, basis="weight", schedule="uniform",
                      rope="commute"), torch.bfloat16),
]
GENERATE_CASES = [c for c in GENERATE_CASES if c[2] in DTYPES]


def tiny_llama(dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def generate(model, ids, mask, backend=None):
    from transformers import CompileConfig

    kwargs = dict(disable_compile=True)
    if backend is not None:  # a function: the config's deep copy keeps the backend itself
        config = CompileConfig(backend=lambda gm, inputs: backend(gm, inputs), mode=None)
        config._compile_all_devices = True
        kwargs = dict(compile_config=config)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, cache_implementation="static",
                              output_logits=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name, options, dtype", GENERATE_CASES,
                         ids=[f"{c[0]}-{c[2]}" for c in GENERATE_CASES])
def test_compiled_generate_over_the_compressed_cache_matches_eager(name, options, dtype):
    """A left-padded batch, a static cache, decode compiled by ``lorc_backend`` (Inductor on a
    GPU): every decode graph's attention rewritten, the eager tokens (float32) or logits within
    bfloat16's rounding, and on CUDA the 16-bit latents read by ``lorc::latent_decode``'s
    Triton kernel."""
    import lorc_fx

    model = tiny_llama(dtype)
    lorc_fx.compress(model, progress=False, **options)
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    expected = generate(model, ids, mask)
    torch._dynamo.reset()
    backend = lorc_fx.lorc_backend.with_options(inductor=not SMOKE)
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) \
        if DEVICE.type == "cuda" else None
    if profile is not None:
        profile.start()
    got = generate(model, ids, mask, backend)
    if profile is not None:
        profile.stop()
    torch._dynamo.reset()
    assert backend.reports and all(r.absorbed == 2 for r in backend.reports)
    logits, reference = torch.stack(got.logits).float(), torch.stack(expected.logits).float()
    if dtype == torch.float32:
        assert torch.equal(got.sequences, expected.sequences)
        torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-3)
    else:  # different kernels round differently: the first step's logits, not the tokens
        assert ((logits[0] - reference[0]).abs().max() / reference[0].abs().max()) < 0.05
    if profile is not None and name == "latent16":
        kernels = {e.name for e in profile.events()}
        assert any("_latent_split_kernel" in k for k in kernels), sorted(kernels)[:20]


def test_the_decode_kernel_serves_a_long_context():
    """``lorc::latent_decode`` over 32k tokens at batch 8 (many sequence splits) against the
    float32 torch path of the op."""
    from lorc_fx.kernels.reference import latent_decode_reference

    n = 2048 if SMOKE else 32768
    gen = torch.Generator(DEVICE).manual_seed(0)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    q = torch.randn(8, 32, 1, 512, generator=gen, device=DEVICE).to(dtype)
    c_k, c_v = (torch.randn(8, n, 512, generator=gen, device=DEVICE).to(dtype) for _ in "kv")
    got = torch.ops.lorc.latent_decode(q[:, :, 0], c_k, c_v, 1 / math.sqrt(128))
    ref = latent_decode_reference(q, c_k, c_v, 1 / math.sqrt(128), dtype=torch.float32)[:, :, 0]
    assert ((got.float() - ref).norm() / ref.norm()).item() < RTOL[dtype]
