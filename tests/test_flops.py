"""megatrain_lightning.planning.flops: model FLOPs against torch's FLOP counter and Hugging Face models, and the
peak table's lookups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.planning import flops


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen"])  # untied head; tied head with q/k/v biases
def test_model_flops_match_the_flop_counter_on_an_ordinary_training_step(preset):
    config = LlamaConfig.from_preset(preset, token_chunk_size=None)  # no tiles: nothing recomputed
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    batch, seq = 3, 48
    ids = torch.randint(config.vocab_size, (batch, seq + 1))
    tokens = batch * seq
    # An ordinary step: full logits from the head and torch's cross-entropy (the model's chunked loss
    # would recompute its logits in backward). The math attention kernel is made of bmm calls the
    # counter sees; the CPU flash kernel is an op it has no formula for.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).backward()
    # The counter counts every matmul (each Linear's forward, input gradient and weight gradient: 6·N per
    # token with N their weights, the head included, tied or not) and nothing elementwise (norms, RoPE,
    # SwiGLU, biases, softmax, the loss) nor the embedding lookup, like model FLOPs. One difference: the
    # math kernel computes all seq² query-key pairs and masks the upper triangle; model FLOPs count the
    # seq·(seq+1)/2 pairs causal attention needs.
    full_square = flops.dense_flops(config, tokens) + flops.attention_flops(config, tokens, seq, causal=False)
    assert counter.get_total_flops() == full_square
    causal = flops.attention_flops(config, tokens, seq)
    assert causal * 2 * seq == flops.attention_flops(config, tokens, seq, causal=False) * (seq + 1)
    assert flops.model_flops(config, tokens, seq) == flops.dense_flops(config, tokens) + causal


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen", "llama-3.1-8b", "qwen2.5-7b"])
def test_matmul_params_are_the_linear_weights(preset):
    config = LlamaConfig.from_preset(preset)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))  # a tied head too
    assert flops.matmul_params(config) == linear
    biases_and_norms = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 1)
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    assert config.num_parameters() == linear + biases_and_norms + embedding


def test_model_flops_of_the_8b_shape_by_hand():
    config = LlamaConfig.from_preset("llama-3.1-8b")
    n = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096  # 7.50B: no embedding
    assert flops.matmul_params(config) == n
    seq, tokens = 4096, 8 * 4096
    attention = 6 * 32 * 32 * 128 * (seq + 1) * tokens
    assert flops.model_flops(config, tokens, seq) == 6 * n * tokens + attention
    with pytest.raises(ValueError, match="whole number of rows"):
        flops.model_flops(config, tokens + 1, seq)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L40", 181),
        ("NVIDIA L4", 121),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 5090", 209.5),
        ("NVIDIA B200", 2250),
        ("Tesla T4", None),
    ],
)
def test_peak_by_device_name(name, tflops):
    peak = flops.peak_bf16_flops(name)
    assert (peak if peak is None else peak / 1e12) == tflops


def test_mfu():
    assert flops.mfu(500e12, 2.0, 1000e12) == 0.25
    with pytest.raises(ValueError):
        flops.mfu(1.0, 0.0, 1e12)


# -- models that are not this project's LlamaConfig --------------------------------------------------


def _hf_twin(config: LlamaConfig) -> nn.Module:
    """The Hugging Face model of `config`'s shapes, built on the meta device (shapes only)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config.to_hf_dict()))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen", "llama-3.1-8b"])  # untied; tied with biases; GQA at size
def test_hf_model_flops_equal_model_flops_of_the_same_shape(preset):
    config = LlamaConfig.from_preset(preset)
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
    assert flops.module_matmul_params(ours) == flops.matmul_params(config)
    hf = _hf_twin(config)
    seq, tokens = 48, 3 * 48
    assert flops.module_matmul_params(hf) == flops.matmul_params(config)
    assert flops.hf_model_flops(hf, tokens, seq) == flops.model_flops(config, tokens, seq)
    with pytest.raises(ValueError, match="whole number of rows"):
        flops.hf_model_flops(hf, tokens + 1, seq)


def test_hf_model_flops_of_gpt2_by_hand():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)  # Conv1D matrices, learned positions, a tied head
    n = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 97 * 32  # c_attn, attn c_proj, c_fc, mlp c_proj; head
    seq, tokens = 16, 2 * 16
    assert flops.hf_model_flops(model, tokens, seq) == 6 * n * tokens + 6 * 2 * 4 * 8 * (seq + 1) * tokens


def test_hf_model_flops_give_no_number_for_what_they_do_not_describe():
    transformers = pytest.importorskip("transformers")
    small = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.device("meta"):
        moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, num_local_experts=4))
        windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=16))
        encoder = transformers.BertForMaskedLM(transformers.BertConfig(**small))
        frozen = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    assert flops.hf_model_flops(moe, 64, 32) is None  # 2 of 4 experts run per token
    assert flops.hf_model_flops(windowed, 32, 16) is not None  # the window covers the row: plain causal
    assert flops.hf_model_flops(windowed, 64, 32) is None
    assert flops.hf_model_flops(encoder, 64, 32) is None  # attends both ways
    frozen.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    assert flops.hf_model_flops(frozen, 64, 32) is None  # no weight gradient for q_proj
    frozen.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    frozen.model.embed_tokens.weight.requires_grad_(False)  # a frozen lookup costs nothing either way
    assert flops.hf_model_flops(frozen, 64, 32) is not None
