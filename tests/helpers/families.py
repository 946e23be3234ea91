"""Tiny random-weight models of the transformers families the pass must handle.

``config_for(family, heads, kv_heads, head_dim, layers, bias, rotary)`` builds a config; the
hypothesis strategy ``architectures()`` draws them. No downloads: weights are random.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st
from transformers import (AutoModelForCausalLM, BloomConfig, DeepseekV3Config, DeepseekV32Config,
                          DeepseekV4Config,
                          FalconH1Config, GemmaConfig, Gemma2Config, Gemma3TextConfig, GPT2Config,
                          GptOssConfig, GPTNeoXConfig, LlamaConfig, Lfm2Config, MiniMaxConfig,
                          MistralConfig, MusicgenMelodyDecoderConfig,
                          OPTConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3NextConfig,
                          XGLMConfig, Zamba2Config)

VOCAB = 96
FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt_neox", "gpt2", "opt", "gemma", "gemma3")
GQA_FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gemma", "gemma3")  # kv heads may differ


def config_for(family: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               layers: int = 2, bias: bool = False, rotary: float = 1.0):
    hidden = heads * head_dim
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama_like = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, **common)
    if family == "llama":
        return LlamaConfig(head_dim=head_dim, attention_bias=bias, **llama_like)
    if family == "mistral":
        return MistralConfig(head_dim=head_dim, sliding_window=None, **llama_like)
    if family == "qwen2":
        return Qwen2Config(**llama_like)
    if family == "qwen2_sliding":  # the upper half of the layers sliding-window
        return Qwen2Config(use_sliding_window=True, sliding_window=4,
                           max_window_layers=layers // 2, **llama_like)
    if family == "qwen3":  # q/k RMSNorm, like gemma3, without sliding layers
        return Qwen3Config(head_dim=head_dim, **llama_like)
    if family == "phi3":
        return Phi3Config(partial_rotary_factor=rotary, **llama_like)
    if family == "gemma":
        return GemmaConfig(head_dim=head_dim, **llama_like)
    if family == "gemma3":
        return Gemma3TextConfig(head_dim=head_dim, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"][:layers]
                                + ["full_attention"] * (layers - 2), **llama_like)
    if family == "gemma3_sliding":  # Gemma 3's pattern: five sliding-window layers, one full
        # (with layers=6; fewer are all sliding)
        return Gemma3TextConfig(head_dim=head_dim, sliding_window=4, **llama_like)
    if family == "gemma2":  # tanh-softcapped attention scores
        return Gemma2Config(head_dim=head_dim, layer_types=["full_attention"] * layers,
                            **llama_like)
    if family == "gpt_oss":  # a learned sink logit per head, in eager attention
        return GptOssConfig(head_dim=head_dim, num_local_experts=2, num_experts_per_tok=1,
                            layer_types=["full_attention"] * layers, **llama_like)
    if family == "lfm2":  # hybrid: short convolutions, then attention
        return Lfm2Config(**{**llama_like, "num_hidden_layers": max(layers, 2)},
                          layer_types=["conv", "full_attention"] * (max(layers, 2) // 2))
    if family == "qwen3_next":  # hybrid: linear attention, then gated attention
        return Qwen3NextConfig(**{**llama_like, "num_hidden_layers": max(layers, 2)},
                               head_dim=head_dim, linear_num_value_heads=2,
                               linear_num_key_heads=2, linear_key_head_dim=16,
                               linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               layer_types=["linear_attention", "full_attention"]
                               * (max(layers, 2) // 2))
    if family == "minimax":  # attention beside lightning attention, in MiniMax's own cache class
        return MiniMaxConfig(**{**llama_like, "num_hidden_layers": max(layers, 2)},
                             head_dim=head_dim, num_local_experts=2, num_experts_per_tok=1,
                             layer_types=["full_attention", "linear_attention"]
                             * (max(layers, 2) // 2))
    if family == "deepseek_v3":  # MLA: keys and values from one normalised latent
        return DeepseekV3Config(**{**llama_like, "num_key_value_heads": heads},
                                kv_lora_rank=2 * head_dim, q_lora_rank=None,
                                qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2,
                                v_head_dim=head_dim, n_routed_experts=2, num_experts_per_tok=1,
                                first_k_dense_replace=layers, moe_intermediate_size=32,
                                n_group=1, topk_group=1)
    if family == "falcon_h1":  # hybrid: Mamba-2 and attention side by side in every layer
        return FalconH1Config(**llama_like, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                              mamba_d_state=16)
    if family == "zamba2":  # Mamba layers, then one shared attention block (layer_idx -1)
        return Zamba2Config(hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, attention_head_dim=head_dim,
                            attention_hidden_size=2 * hidden, kv_channels=head_dim,
                            num_query_groups=heads, mamba_d_state=16, mamba_headdim=16,
                            layers_block_type=["mamba"] * (layers - 1) + ["hybrid"], **common)
    if family == "deepseek_v32":  # MLA beside an indexer whose keys the cache keeps too
        return DeepseekV32Config(**{**llama_like, "num_key_value_heads": heads},
                                 kv_lora_rank=2 * head_dim, q_lora_rank=2 * head_dim,
                                 qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2,
                                 v_head_dim=head_dim, index_head_dim=head_dim, index_n_heads=2,
                                 n_routed_experts=2, num_experts_per_tok=1,
                                 first_k_dense_replace=layers, moe_intermediate_size=32,
                                 n_group=1, topk_group=1)
    if family == "deepseek_v4":  # cache layers of its own: a window whose keys are its values
        # beside compressors' pending tokens, pooled entries and an indexer's keys
        return DeepseekV4Config(**{**llama_like, "num_key_value_heads": 1},
                                layer_types=["heavily_compressed_attention",
                                             "compressed_sparse_attention"] * max(layers // 2, 1),
                                compress_rates={"compressed_sparse_attention": 4,
                                                "heavily_compressed_attention": 8},
                                sliding_window=8, head_dim=head_dim, q_lora_rank=2 * head_dim,
                                o_groups=2, o_lora_rank=head_dim, index_n_heads=2,
                                index_head_dim=head_dim, index_topk=4, hc_mult=2,
                                n_routed_experts=2, num_experts_per_tok=1,
                                moe_intermediate_size=32, mlp_layer_types=["moe"] * layers)
    if family == "musicgen_melody":  # its generate prepares no cache: its forward builds one
        return MusicgenMelodyDecoderConfig(
            hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_codebooks=1, decoder_start_token_id=1, **common)
    if family == "gpt_neox":
        return GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             rotary_pct=rotary, attention_bias=True, **common)
    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64, **common)
    if family == "opt":
        return OPTConfig(hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, max_position_embeddings=64,
                         word_embed_proj_dim=hidden, enable_bias=bias, **common)
    if family == "bloom":  # heads merged into the batch for baddbmm, ALiBi as its input
        return BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, **common)
    if family == "xglm":  # heads merged into the batch for bmm
        return XGLMConfig(d_model=hidden, ffn_dim=2 * hidden, num_layers=layers,
                          attention_heads=heads, max_position_embeddings=64, **common)
    raise ValueError(family)


def build(config, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model


@st.composite
def architectures(draw, families=FAMILIES):
    family = draw(st.sampled_from(families))
    heads = draw(st.sampled_from([2, 4, 6]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 3, 6) if heads % d == 0]))
    if family not in GQA_FAMILIES:
        kv_heads = heads
    head_dim = draw(st.sampled_from([8, 16]))
    rotary = draw(st.sampled_from([0.5, 1.0])) if family in ("gpt_neox", "phi3") else 1.0
    bias = draw(st.booleans())
    return family, config_for(family, heads, kv_heads, head_dim, draw(st.integers(1, 3)) if
                              family != "gemma3" else 2, bias, rotary)


def relu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """A custom eager attention (squared-ReLU weights, no softmax) the analysis finds no
    attention in: registered as ``"relu_sq"`` by :func:`custom_attention_llama`."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = torch.relu(scores) ** 2
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-6)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def custom_attention_llama(seed: int = 0):
    """A tiny Llama running :func:`relu_attention` through transformers' attention
    interface."""
    from transformers import AttentionInterface

    AttentionInterface.register("relu_sq", relu_attention)
    config = config_for("llama")
    config._attn_implementation = "relu_sq"
    return build(config, seed)


def llama_with_one_custom_attention_layer(seed: int = 0):
    """A tiny Llama of two layers whose second runs :func:`relu_attention` (its own copy of
    the config names it): the analysis proves layer 0 alone."""
    import copy

    model = custom_attention_llama(seed)
    model.config._attn_implementation = "eager"
    first = model.model.layers[0].self_attn
    first.config = copy.copy(model.config)
    model.model.layers[1].self_attn.config = own = copy.copy(model.config)
    own._attn_implementation = "relu_sq"
    return model
