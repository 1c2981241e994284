"""Model FLOPs of training a Llama-family decoder, and the dense bf16 peaks MFU divides them by.

One definition for everything that counts model FLOPs (bench/throughput.py; the planner and the schedule
model can share it):

    model FLOPs = 6 · N · tokens                         the dense part
                + 6 · layers · heads · head_dim · (seq + 1) · tokens     causal attention

- N = the parameters that multiply: every weight matrix of the blocks (q, k, v, o, gate, up, down) and
  the output head (a tied head too: its matmul runs either way). The input embedding is a lookup and
  has no FLOPs; RMSNorm gains and q/k/v biases scale and add elementwise (under 0.01% of N at 1B) and
  are left out, as every elementwise op is. 6 = 2 (multiply-add) x 3 (forward, the input gradient and
  the weight gradient of backward).
- Attention: QKᵀ and the scores times V, 2 · head_dim FLOPs each per query-key pair and query head,
  forward and twice that in backward (12 · head_dim per pair). Causal attention needs the pairs on and
  below the diagonal, seq · (seq + 1) / 2 per row of seq tokens: (seq + 1) / 2 per token. Flash kernels
  skip the blocks above the diagonal; a kernel that computes the full square and masks it does more
  work than the model needs, which MFU does not credit.
- Other models (Hugging Face's): :func:`hf_model_flops` reads N off the built module (its weight
  matrices) and the attention shape off its ``config``, and gives no number for what this count does not
  describe (mixture of experts, sliding windows shorter than the sequence, frozen matrices, ...).
- Not counted: recompute (the engine recomputes every block in backward, the chunked loss recomputes
  its logits, a flash backward recomputes the scores): MFU measures the model's work, not the
  implementation's. Padding: counted as if it were tokens (this package's packed rows have none).

MFU = model FLOPs / step seconds / the GPU's dense bf16 peak (:data:`PEAK_BF16_FLOPS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from megatrain_lightning.models.config import LlamaConfig

# Dense (no 2:4 sparsity) bf16 tensor-core peaks with fp32 accumulation, FLOP/s, from the vendor's
# datasheets and architecture whitepapers (their headline figures are often the sparse ones: halved
# here). The first key found in torch.cuda.get_device_name() wins: more specific names come first
# ("GH200" before "H200", "H100 PCIe" before "H100", "L40S" and "L40" before "L4").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),  # GH200 Grace Hopper datasheet: BF16 1,979 TFLOPS with sparsity (the H100 SXM figure)
    ("H200 NVL", 835e12),  # H200 NVL datasheet: BF16 1,671 TFLOPS with sparsity
    ("H200", 989e12),  # H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity
    ("H100 PCIe", 756e12),  # H100 datasheet, PCIe: BF16 1,513 TFLOPS with sparsity
    ("H100 NVL", 835e12),  # H100 NVL datasheet: BF16 1,671 TFLOPS with sparsity
    ("H100", 989e12),  # H100 datasheet, SXM5 ("H100 80GB HBM3"): BF16 1,979 TFLOPS with sparsity
    ("B200", 2250e12),  # HGX B200 datasheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity
    ("A100", 312e12),  # A100 datasheet (SXM4 and PCIe): BF16 312 TFLOPS dense, 624 with sparsity
    ("L40S", 362e12),  # L40S datasheet: BF16 362.05 TFLOPS dense, 733 with sparsity
    ("L40", 181e12),  # L40 datasheet: BF16 181.05 TFLOPS dense, 362.1 with sparsity
    ("L4", 121e12),  # L4 datasheet: BF16 242 TFLOPS with sparsity
    # GeForce cards run fp16/bf16 with fp32 accumulation at half their fp16-accumulate rate; training
    # accumulates in fp32, so that is the peak. Ada whitepaper, RTX 4090: BF16 with FP32 accumulate
    # 165.2 dense / 330.4 sparse (the 330 / 660 headline figures are fp16-accumulate or sparse).
    ("RTX 4090", 165.2e12),
    # RTX Blackwell whitepaper, RTX 5090: FP16/BF16 with FP32 accumulate 209.5 dense (419 dense / 838
    # sparse are the fp16-accumulate figures). Check it against a measured bf16 matmul on a first run.
    ("RTX 5090", 209.5e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU named `device_name` (torch.cuda.get_device_name), None if unknown."""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in device_name), None)


def matmul_params(config: LlamaConfig) -> int:
    """N of 6·N: the weight matrices of every block and the output head (see the module docstring)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    block = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    return config.num_hidden_layers * block + config.vocab_size * h


def dense_flops(config: LlamaConfig, tokens: int) -> int:
    """6·N·tokens: every weight matrix forward and backward."""
    return 6 * matmul_params(config) * tokens


def attention_flops(config: LlamaConfig, tokens: int, seq_len: int, causal: bool = True) -> int:
    """QKᵀ and scores·V, forward and backward, for `tokens` in rows of `seq_len`: causal counts the
    seq·(seq+1)/2 query-key pairs of a row that the model needs, `causal=False` all seq² of them."""
    _check(tokens, seq_len)
    per_pair = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    if causal:
        return per_pair * tokens * (seq_len + 1) // 2  # tokens·(seq+1) is even: tokens is a multiple of seq
    return per_pair * tokens * seq_len


def model_flops(config: LlamaConfig, tokens: int, seq_len: int) -> int:
    """Model FLOPs of training on `tokens` tokens in rows of `seq_len`: dense part + causal attention."""
    return dense_flops(config, tokens) + attention_flops(config, tokens, seq_len)


# Config fields that mean more than dense blocks of causal attention: experts (of which only some run per
# token), low-rank latent attention (query/key and value heads of different widths), other towers.
_NOT_DENSE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "kv_lora_rank",
    "is_encoder_decoder",
    "text_config",
    "vision_config",
    "audio_config",
)


def module_matmul_params(model: nn.Module) -> int | None:
    """N of 6·N read off a built module: its 2-D weights, but not an input embedding's (a lookup) unless a
    Linear head shares it (a tied head). None where 6·N would be wrong: a parameter of more than 2
    dimensions (stacked experts, convolutions) or a frozen matrix (no weight gradient: 4, not 6, per token).
    On this project's model it equals :func:`matmul_params` of its config."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    n = 0
    for p in model.parameters():  # each Parameter once, a tied one too
        if p.ndim > 2:
            return None
        if p.ndim == 2 and (id(p) not in embeddings or id(p) in heads):
            if not p.requires_grad:
                return None
            n += p.numel()
    return n


def hf_attention_shape(config: Any, seq_len: int) -> tuple[int, int, int] | None:
    """(layers, query heads, head_dim) of a Hugging Face decoder's ``config`` where each of its layers runs
    full causal attention over rows of `seq_len` tokens; None where the config says otherwise or is missing
    a field (see ``_NOT_DENSE_FIELDS``; a sliding window shorter than the row; layers of another kind)."""
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not (isinstance(layers, int) and isinstance(heads, int) and heads > 0):
        return None
    if any(getattr(config, field, None) for field in _NOT_DENSE_FIELDS):
        return None
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window and seq_len > window:  # a window at least the row's length attends to the whole row
        return None
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}:
        return None  # linear attention, state-space layers
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    return (layers, heads, head_dim) if head_dim > 0 else None


def hf_model_flops(model: nn.Module, tokens: int, seq_len: int) -> int | None:
    """Model FLOPs, as :func:`model_flops` counts them, of training a Hugging Face causal LM ``model`` on
    `tokens` tokens in rows of `seq_len`: 6·N from :func:`module_matmul_params` and causal attention from
    :func:`hf_attention_shape` of its ``config``. None where either cannot describe the model, and for a
    model that does not generate (``can_generate()``: an encoder attends both ways, a seq² count)."""
    _check(tokens, seq_len)
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        return None
    n, shape = module_matmul_params(model), hf_attention_shape(getattr(model, "config", None), seq_len)
    if n is None or shape is None:
        return None
    layers, heads, head_dim = shape
    return 6 * n * tokens + 6 * layers * heads * head_dim * (seq_len + 1) * tokens  # as attention_flops


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilization: `flops` of model work done in `seconds` over a peak of `peak` FLOP/s."""
    if not (seconds > 0 and peak > 0):
        raise ValueError(f"seconds={seconds} and peak={peak} must both be positive")
    return flops / seconds / peak


def _check(tokens: int, seq_len: int) -> None:
    if seq_len <= 0 or tokens < 0 or tokens % seq_len:
        raise ValueError(
            f"tokens={tokens} must be a whole number of rows of seq_len={seq_len} (a positive "
            "length); count the tokens of full rows"
        )
