"""Hand-written attention models (nanoGPT style) for the graph-analysis tests.

Manual ``softmax(q @ k^T * scale + mask) @ v`` attention, RoPE applied in ``(b, t, h, d)``
layout in several spellings, optional GQA via ``repeat_interleave``, fused or split qkv.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 61


def rotate(x: torch.Tensor, positions: torch.Tensor, style: str, rotary_dim: int) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x`` (b, t, h, d); the rest pass through."""
    if style == "none":
        return x
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = positions[:, None].float() * inv_freq[None, :]            # (t, r/2)
    if style == "complex":
        freqs = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
        z = torch.view_as_complex(rot.float().reshape(*rot.shape[:-1], -1, 2))
        rot = torch.view_as_real(z * freqs).flatten(3).type_as(x)
    elif style == "interleaved":
        cos = angles.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
        sin = angles.sin().repeat_interleave(2, dim=-1)[None, :, None, :]
        pairs = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        rot = rot * cos + pairs * sin
    elif style == "half":
        cos = torch.cat([angles.cos()] * 2, dim=-1)[None, :, None, :]
        sin = torch.cat([angles.sin()] * 2, dim=-1)[None, :, None, :]
        half = rotary_dim // 2
        rot = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    else:
        raise ValueError(style)
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot


class ToyAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, rope="none", rotary_dim=None,
                 fused=False, bias=False, key_op=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope, self.rotary_dim = rope, rotary_dim or head_dim
        self.key_op = key_op
        widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.widths = widths
        if fused:
            self.qkv = nn.Linear(dim, sum(widths), bias=bias)
        else:
            self.q, self.k, self.v = (nn.Linear(dim, w, bias=bias) for w in widths)
        if key_op == "sum":
            self.k2 = nn.Linear(dim, widths[1], bias=bias)
        self.proj = nn.Linear(heads * head_dim, dim, bias=bias)

    def project(self, x):
        if hasattr(self, "qkv"):
            return self.qkv(x).split(self.widths, dim=-1)
        k = self.k(x)
        if self.key_op == "tanh":
            k = torch.tanh(k)
        elif self.key_op == "sum":
            k = k + self.k2(x)
        return self.q(x), k, self.v(x)

    def forward(self, x):
        b, t, _ = x.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.project(x)
        positions = torch.arange(t, device=x.device)
        q = rotate(q.view(b, t, h, d), positions, self.rope, self.rotary_dim).transpose(1, 2)
        k = rotate(k.view(b, t, kvh, d), positions, self.rope, self.rotary_dim).transpose(1, 2)
        v = v.view(b, t, kvh, d).transpose(1, 2)
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, h * d)
        return self.proj(y)


class ToyBlock(nn.Module):
    def __init__(self, dim, graph_break=False, **attn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ToyAttention(dim, **attn)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.graph_break = graph_break

    def forward(self, x):
        if self.graph_break:
            torch._dynamo.graph_break()
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ToyGPT(nn.Module):
    """``ToyGPT(dim, layers, heads=..., kv_heads=..., head_dim=..., rope=..., ...)``."""

    def __init__(self, dim=32, layers=2, graph_break=False, **attn):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, graph_break, **attn) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ToyMLP(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, VOCAB))

    def forward(self, idx):
        return self.net(self.emb(idx))
