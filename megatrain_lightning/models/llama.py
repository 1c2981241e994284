"""A Llama-family decoder (Llama 2/3.x, Qwen2/2.5) as plain ``nn.Module``s.

Module and parameter names equal those of Hugging Face's ``LlamaForCausalLM`` /
``Qwen2ForCausalLM``, so their state dicts load key for key (see ``hf_io``).

Design constraints that come from the streaming engine, which swaps one decoder layer's parameters
in and out of the GPU and re-runs layers for backward:

* ``DecoderLayer.forward(hidden_states, cos, sin)`` takes only positional tensors and is a pure
  function of its parameters and inputs: layers hold no buffers, no caches and no layer index.
* RoPE cos/sin are computed once per forward at model level (``LlamaModel.rotary_emb``) and passed
  to every layer. ``rotary_emb`` keeps its inverse frequencies in a plain per-device cache rather
  than a buffer, so ``to_empty``/meta-device construction cannot leave it uninitialized and it never
  shows up in a state dict.

Dtypes: everything computes in the parameters' dtype (fp32 or bf16), except RMSNorm statistics,
RoPE angles, attention's internal softmax and the loss, which use fp32 as in HF.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch import nn

from .config import LlamaConfig
from .loss import chunked_cross_entropy


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32, then cast back *before* the weight multiply: this is HF's exact
        # order of operations, which is what makes bf16 outputs bit-compatible with theirs.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """fp32 inverse frequencies [head_dim // 2] on CPU, with llama3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    # Llama 3.1 scaling: long wavelengths (beyond the original context) are slowed down by
    # `factor`, short ones are untouched, and the band between is blended linearly in 1/wavelength.
    factor, old_ctx = rs["factor"], rs["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / rs["low_freq_factor"]
    high_freq_wavelen = old_ctx / rs["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # Computed on CPU (like HF) and copied once per device, so CUDA and CPU runs use identical
        # frequencies and the forward pass does no host-to-device copy after the first call.
        device = torch.device(device)
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.config).to(device)
        return self._inv_freq[device]

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B or 1, T, head_dim] in ``dtype`` for integer ``position_ids`` [B or 1, T]."""
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq(position_ids.device)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by position; cos/sin are [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # kv heads are repeated explicitly instead of passing enable_gqa=True: with fp32 inputs on
        # CUDA only the memory-efficient kernel applies and it has no GQA support, so enable_gqa
        # would silently fall back to the math kernel that materializes the T x T scores.
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU; with ``mlp_chunk_size`` tiled over tokens, each tile recomputed in backward, so its
    intermediates (about 4 x intermediate_size values per token) exist for one tile at a time."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.chunk = config.mlp_chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk is None or x.shape[-2] <= self.chunk:
            return self.swiglu(x)
        tiles = x.split(self.chunk, dim=-2)  # tokens are independent here
        if torch.is_grad_enabled():
            # No randomness inside: the recompute needs no RNG state.
            return torch.cat([checkpoint(self.swiglu, t, use_reentrant=False, preserve_rng_state=False) for t in tiles], -2)
        return torch.cat([self.swiglu(t) for t in tiles], -2)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block; a pure function of (parameters, hidden_states, cos, sin)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm: input ids -> final normed hidden states."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def position_embeddings(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch; positions default to 0..T-1 shared by all rows."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        elif position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        return self.rotary_emb(position_ids, dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.position_embeddings(input_ids, position_ids, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Decoder plus output head; names and numerics follow HF's ``LlamaForCausalLM``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding Parameter itself when the config ties them.

        Must be re-run after anything that re-creates parameters per module (``to_empty`` from the
        meta device, for instance), which silently unties them.
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) matrices and embeddings, zero biases, unit norm weights."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] in the parameters' dtype, or with ``targets`` the scalar fp32 mean loss.

        ``targets`` [B, T] are already aligned (``targets[b, t]`` is the label of position t,
        -100 ignored); nothing is shifted here. The loss never materializes the full logits.
        """
        hidden_states = self.model(input_ids, position_ids)
        if targets is None:
            return self.lm_head(hidden_states)
        return self.loss_from_hidden(hidden_states, targets)

    def loss_from_hidden(self, hidden_states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Chunked mean cross-entropy from final normed hidden states [..., H] and targets [...]."""
        return chunked_cross_entropy(
            hidden_states.reshape(-1, hidden_states.shape[-1]),
            self.lm_head.weight,
            targets.reshape(-1),
            self.config.loss_chunk_size,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``input_ids`` [B, T]; returns [B, T + new].

        No KV cache: every step recomputes the whole (cropped) context, which is simple and fine
        for demos. ``temperature=0`` means greedy decoding.
        """
        ids = input_ids
        for _ in range(max_new_tokens):
            context = ids[:, -self.config.max_position_embeddings:]
            logits = self(context)[:, -1, :].float()
            ids = torch.cat((ids, _sample(logits, temperature, top_k)), dim=1)
        return ids


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """One token id per row [B, 1] from last-position logits [B, V]."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
