"""More decoder families for the zoo (tests/test_zoo.py::test_family_trains_like_ordinary_training).

Each is the smallest configuration of its family that still has the features that set it apart (ALiBi,
parallel attention, partial rotary, QK norms, post-norms, logit scaling, sliding windows, rope scaling,
multi-head latent attention, routed and shared experts, a state-space block, hybrids of attention and
state-space layers, a transformer block shared by several layers, an encoder-decoder handing position biases
between blocks), built locally from a config (no download): 2 layers, width 32, the zoo's vocabulary of 97,
every dropout the family has on (but T5's: see ``t5``).
Each builder names only what differs from ``hf_model``'s small GQA decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.helpers import AUX_COEF, DROPOUT, VOCAB, Zoo, _seeded, hf_model

# Token ids inside the zoo's vocabulary (some families default to ids of their real tokenizer's).
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Config fields of the GQA shape that the GPT-2-style families name differently.
GPT_SHAPE = dict(
    hidden_size=None, intermediate_size=None, num_hidden_layers=None, num_attention_heads=None, num_key_value_heads=None
)


def falcon_alibi() -> nn.Module:
    # The first Falcon layout: ALiBi instead of rotary, multi-query attention, attention and MLP in parallel.
    return hf_model(
        "Falcon",
        intermediate_size=None,
        num_key_value_heads=None,
        ffn_hidden_size=64,
        alibi=True,
        multi_query=True,
        parallel_attn=True,
        bias=True,
        new_decoder_architecture=False,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def falcon_new() -> nn.Module:
    # new_decoder_architecture: grouped KV heads, two layer norms feeding the parallel attention and MLP.
    return hf_model(
        "Falcon",
        intermediate_size=None,
        num_key_value_heads=None,
        ffn_hidden_size=64,
        num_kv_heads=2,
        new_decoder_architecture=True,
        alibi=False,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="sdpa",
    )


def gptj() -> nn.Module:
    # Rotary on the first 4 of 8 head dims (interleaved), parallel attention and MLP under one layer norm.
    return hf_model(
        "GPTJ",
        **GPT_SHAPE,
        **IDS,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=64,
        rotary_dim=4,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attn_pdrop=DROPOUT,
        attn_implementation="eager",
    )


def bloom() -> nn.Module:
    # ALiBi, per-head fused [q|k|v], a layer norm on the embeddings.
    return hf_model(
        "Bloom",
        **{**GPT_SHAPE, "hidden_size": 32},
        n_layer=2,
        n_head=4,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
    )


def stablelm() -> nn.Module:
    return hf_model(
        "StableLm",
        partial_rotary_factor=0.25,
        use_qkv_bias=True,
        qk_layernorm=True,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def phi() -> nn.Module:
    return hf_model(
        "Phi",
        partial_rotary_factor=0.5,
        qk_layernorm=True,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def olmo() -> nn.Module:
    # clip_qkv clamps q, k and v: elements at the clamp get a zero gradient.
    return hf_model("Olmo", **IDS, clip_qkv=8.0, attention_dropout=DROPOUT, attn_implementation="eager")


def olmo2() -> nn.Module:
    # No pre-norm: norms after attention and MLP, and RMS norms over the whole q and k projections.
    return hf_model("Olmo2", **IDS, attention_dropout=DROPOUT, attn_implementation="eager")


def cohere() -> nn.Module:
    # Parallel attention and MLP, per-head QK layer norms, logits scaled, tied head.
    return hf_model(
        "Cohere", **IDS, use_qk_norm=True, logit_scale=0.5, attention_dropout=DROPOUT, attn_implementation="eager"
    )


def granite() -> nn.Module:
    # Multipliers on the embeddings, the residual branches and the attention scores; logits divided.
    return hf_model(
        "Granite",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def starcoder2() -> nn.Module:
    # sliding_window < the zoo's sequence of 16: the window's mask is exercised.
    return hf_model(
        "Starcoder2",
        sliding_window=8,
        residual_dropout=DROPOUT,
        embedding_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="sdpa",
    )


def llama3_rope() -> nn.Module:
    # With an original context of 16 and head_dim 8, the four rotary frequencies fall in each of llama3's
    # bands: one kept, one smoothed, two divided by the factor.
    rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return hf_model("Llama", rope_parameters=rope, attention_dropout=DROPOUT, attn_implementation="eager")


def gemma3() -> nn.Module:
    # The text-only Gemma3ForCausalLM: a sliding layer (window 4) then a global one, QK norms, tied head.
    return hf_model(
        "Gemma3Text",
        model_class="Gemma3ForCausalLM",
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
        sliding_window_pattern=2,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def qwen3_moe(router_aux_loss_coef: float = AUX_COEF) -> nn.Module:
    return hf_model(
        "Qwen3Moe",
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=router_aux_loss_coef,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def _deepseek(family: str, **config: Any) -> nn.Module:
    # Multi-head latent attention (low-rank KV, decoupled rotary dims), a dense first layer then a layer of
    # routed plus shared experts: blocks of one class but different sizes.
    return hf_model(
        family,
        num_key_value_heads=4,  # MLA expands the latent KV to every head
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
        **config,
    )


def deepseek_v2() -> nn.Module:
    return _deepseek("DeepseekV2")


def deepseek_v3() -> nn.Module:
    # Group-limited routing (2 groups, the top one kept) with the score-correction bias.
    return _deepseek("DeepseekV3", n_group=2, topk_group=1)


def mamba() -> nn.Module:
    # A selective state-space block (conv + scan, the reference PyTorch path), no attention at all.
    return hf_model(
        "Mamba",
        **{**GPT_SHAPE, "hidden_size": 32, "num_hidden_layers": 2},
        **IDS,
        state_size=4,
        expand=2,
        time_step_rank=4,
    )


MAMBA = dict(mamba_d_state=4, mamba_expand=2, **IDS)


def jamba() -> nn.Module:
    # Attention and mamba layers, two classes in one list; the mamba ones with a 2-expert MoE: two sizes.
    return hf_model(
        "Jamba",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_dt_rank=4,
        attention_dropout=DROPOUT,
        **MAMBA,
    )


def bamba() -> nn.Module:
    # One class whose blocks are mamba or attention by configuration: two sizes.
    return hf_model(
        "Bamba", num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, **MAMBA
    )


def zamba2() -> nn.Module:
    # Mamba layers and hybrid layers; every hybrid layer holds the one shared transformer block (with per-layer
    # LoRA adapters): its parameters are shared between blocks, held once as outer parameters.
    return hf_model(
        "Zamba2",
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_headdim=8,
        n_mamba_heads=8,
        mamba_ngroups=1,
        num_mem_blocks=1,
        adapter_rank=4,
        **MAMBA,
    )


def t5() -> nn.Module:
    # An encoder-decoder: both stacks stream, of different depths (3 and 2), gated-GELU feed-forwards, the
    # decoder's output not rescaled before the head (tie_word_embeddings=False), other relative-position buckets. Each stack's first block makes the position bias its later blocks
    # take, and the decoder's first block a cross-attention bias of zeros (no grad) the later ones take too.
    # Dropout off, unlike the other families: with dropout on, CPU attention takes one kernel whatever
    # requires grad; without, it takes another when the additive mask (the bias) requires grad, so a forward
    # outside grad mode, or a bias of zeros made to require grad, computed other values (1e-5 after 3 steps).
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=16,
        relative_attention_max_distance=20, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False,  # here: the stacks copy the config before _seeded could turn the cache off
    )  # fmt: skip
    return _seeded(lambda: T5ForConditionalGeneration(cfg))


def _falcon_mq_key(t: torch.Tensor, head_dim: int = 8) -> torch.Tensor:
    """Multi-query Falcon's fused query_key_value bias is [q (all heads) | k (one head) | v (one head)]."""
    mask = torch.zeros_like(t, dtype=torch.bool)
    mask[-2 * head_dim : -head_dim] = True
    return mask


FAMILIES: dict[str, Zoo] = {
    # A key bias has zero true gradient (softmax ignores q.b_k, the same for every key of a row; ALiBi's
    # position term does not change that): excluded from the native comparison, as in helpers.ZOO.
    "falcon-alibi": Zoo(falcon_alibi, key_bias={"self_attention.query_key_value.bias": _falcon_mq_key}),
    "falcon-new": Zoo(falcon_new),
    "gptj": Zoo(gptj),
    "bloom": Zoo(bloom),
    "stablelm": Zoo(stablelm),
    "phi": Zoo(phi),
    "olmo": Zoo(olmo),
    "olmo2": Zoo(olmo2),
    "cohere": Zoo(cohere),
    "granite": Zoo(granite),
    "starcoder2": Zoo(starcoder2),
    "llama3-rope": Zoo(llama3_rope),
    "gemma3": Zoo(gemma3),
    "qwen3-moe-aux": Zoo(qwen3_moe),
    "deepseek-v2": Zoo(deepseek_v2),
    "deepseek-v3": Zoo(deepseek_v3),
    "mamba": Zoo(mamba),
    "jamba": Zoo(jamba),
    "bamba": Zoo(bamba),
    "zamba2": Zoo(zamba2),
    "t5": Zoo(t5),
}
