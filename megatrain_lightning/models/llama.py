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
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .loss import chunked_cross_entropy
from .ops import autograd_records, rms_norm
from .tiled_attention import tiled_attention
from .tiling import attention_block, resolve_core, resolve_tile, run_tile

Segments = tuple[tuple[tuple[int, int], ...], ...] | None
"""Per row (one row standing for all), the (start, end) token spans of its documents."""


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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
        """cos, sin of shape [B or 1, T, head_dim] in ``dtype`` for integer ``position_ids`` [B or 1, T].
        Each holds every frequency twice (first and second half alike, as in HF), computed once."""
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq(position_ids.device)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by position; cos/sin are [B, T, head_dim] with equal halves.

    HF's ``x * cos + rotate_half(x) * sin`` (rotate_half(x) = [-x2, x1]) half by half, without building
    the rotated copy: [x1 c - x2 s, x2 c + x1 s], subtracted and added in place into ``x * cos``. Every
    product and sum rounds exactly as HF's do (negation is exact), in fp32 and bf16 alike."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos
    out[..., :half].sub_(x2 * sin)  # single views (not chunk's) may be written in place under autograd
    out[..., half:].add_(x1 * sin)
    return out


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments = None) -> torch.Tensor:
        return self.project_out(self.core(*self.project(x, cos, sin), segments))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated q [B, heads, T, hd] and k, v [B, kv_heads, T, hd] of the (normed) input x [B, T, H]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments = None) -> torch.Tensor:
        """Causal attention [B, heads, T, hd]; with `segments`, each document attends only to itself."""
        groups = self.num_heads // self.num_kv_heads
        # bf16 kernels (flash) share each kv head among its query heads natively (enable_gqa). With fp32
        # inputs on CUDA only the memory-efficient kernel applies and it has no GQA support, so there
        # enable_gqa would silently fall back to the math kernel that materializes the T x T scores:
        # fp32 repeats the kv heads instead.
        gqa = groups > 1 and q.dtype != torch.float32
        if groups > 1 and not gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if segments is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        rows = []
        for b, spans in enumerate(segments if len(segments) == q.shape[0] else segments * q.shape[0]):
            parts = [
                F.scaled_dot_product_attention(
                    q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True, enable_gqa=gqa
                )
                for s, e in spans
            ]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [B, heads, T, hd] -> [B, T, H]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: one elementwise expression, which torch.compile fuses into one kernel. Without a
    graph the product lands in place in silu's output (the same bits, one temporary fewer)."""
    if autograd_records(gate, up):
        return F.silu(gate) * up
    return F.silu(gate).mul_(up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block; a pure function of its parameters and arguments."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: Segments = None,
        tile: int | None = None,
        tiled_core: bool = False,
    ) -> torch.Tensor:
        """`segments`: per row, the (start, end) token spans of its documents (None: one causal sequence).
        `tile`: tokens per tile (models/tiling.py); None: untiled. `tiled_core`: with tiles, the attention core
        too runs over blocks of queries (models/tiled_attention.py) instead of the fused kernel."""
        if tile is not None:
            return self._tiled(hidden_states, cos, sin, segments, tile, tiled_core)
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, segments)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def _tiled(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments, tile: int, tiled_core: bool
    ) -> torch.Tensor:
        """The same function tile by tile: q/k/v per tile, attention over the whole sequence (fused, or itself
        in blocks of queries), the rest (o_proj, residual, second norm, MLP) per tile. Outside the attention
        core tokens are independent."""
        xs = x.split(tile, dim=1)
        qkv = [run_tile(self._project_tile, *t) for t in zip(xs, cos.split(tile, dim=1), sin.split(tile, dim=1))]
        q, k, v = (torch.cat(parts, dim=2) for parts in zip(*qkv))
        del qkv  # the tiles' own outputs: only the concatenated q, k, v live on
        if tiled_core:
            out = tiled_attention(q, k, v, segments, attention_block(tile))
        else:
            out = self.self_attn.core(q, k, v, segments)
        return torch.cat([run_tile(self._rest_tile, xt, ot) for xt, ot in zip(xs, out.split(tile, dim=2))], dim=1)

    def _project_tile(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def _rest_tile(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.project_out(attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm: input ids -> final normed hidden states."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.config = config

    def position_embeddings(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch; positions default to 0..T-1 shared by all rows."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        elif position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        return self.rotary_emb(position_ids, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        final_norm: bool = True,
        tile: int | None | Literal["config"] = "config",
        tiled_core: bool | Literal["config"] = "config",
    ) -> torch.Tensor:
        """Final normed hidden states (with ``final_norm=False`` the last block's output).

        Where ``position_ids`` restart at 0 inside a row, a new document begins, and attention keeps to
        documents (as Hugging Face's flash-attention path does for packed sequences). ``tile``: tokens per
        tile of every block, by default as the config's ``token_chunk_size`` resolves for this input;
        ``tiled_core``: whether tiled blocks tile their attention core, by default as ``tiled_attention`` does."""
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.position_embeddings(input_ids, position_ids, hidden_states.dtype)
        segments = document_segments(position_ids)
        if tile == "config":
            tile = self.tile_for(input_ids)
        if tiled_core == "config":
            tiled_core = self.tiled_core_for(input_ids, tile)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, segments, tile, tiled_core)
        return self.norm(hidden_states) if final_norm else hidden_states

    def tile_for(self, input_ids: torch.Tensor) -> int | None:
        """Tokens per tile for a pass over `input_ids` [B, T] (None: untiled); resolved once per pass, so
        every block, and its recompute in backward, uses the same tiles."""
        weight = self.embed_tokens.weight
        tokens = input_ids.shape[-1]
        return resolve_tile(self.config, tokens, input_ids.numel() // tokens, weight.device, weight.element_size())

    def tiled_core_for(self, input_ids: torch.Tensor, tile: int | None) -> bool:
        """Whether blocks tiled by `tile` tokens tile their attention core for a pass over `input_ids`, resolved
        once per pass like the tile (False when untiled)."""
        if tile is None:
            return False
        weight = self.embed_tokens.weight
        tokens = input_ids.shape[-1]
        return resolve_core(self.config, tokens, input_ids.numel() // tokens, weight.device, weight.element_size())


def document_segments(position_ids: torch.Tensor | None) -> Segments:
    """Per row of `position_ids` [B or 1, T], the (start, end) spans of its documents (one starts wherever
    the position is 0); None when no row holds more than one. Reads the positions on the host: one sync
    per forward pass, and only when positions are given."""
    if position_ids is None:
        return None
    rows = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    starts = [[0] + (row[1:] == 0).nonzero().flatten().add(1).tolist() for row in rows]
    if all(len(s) == 1 for s in starts):
        return None
    end = rows.shape[-1]
    return tuple(tuple(zip(s, s[1:] + [end])) for s in starts)


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
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """One module's own parameters (as HF's method of that name): what a model built without weights gets,
        module by module, as its parameters get memory (engine/host/materialize.py)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, self.config.initializer_range)
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
        tile = self.model.tile_for(input_ids)
        core = self.model.tiled_core_for(input_ids, tile)
        if targets is None:
            return self.lm_head(self.model(input_ids, position_ids, tile=tile, tiled_core=core))
        # Tiled (long context), or more tokens than one loss chunk (many rows: layer-major steps): the final norm
        # runs chunk by chunk inside the loss, so neither the normed states nor the norm's fp32 copies of the
        # whole micro-batch (five of them in its backward) are made.
        fold = tile is not None or input_ids.numel() > self.config.loss_chunk_size
        hidden_states = self.model(input_ids, position_ids, final_norm=not fold, tile=tile, tiled_core=core)
        return self.loss_from_hidden(hidden_states, targets, normed=not fold)

    def loss_from_hidden(self, hidden_states: torch.Tensor, targets: torch.Tensor, normed: bool = True) -> torch.Tensor:
        """Chunked mean cross-entropy from hidden states [..., H] and targets [...]: final normed states, or
        with ``normed=False`` the last block's output, which the loss normalizes chunk by chunk."""
        norm = None if normed else self.model.norm
        return chunked_cross_entropy(
            hidden_states.reshape(-1, hidden_states.shape[-1]),
            self.lm_head.weight,
            targets.reshape(-1),
            self.config.loss_chunk_size,
            norm=None if norm is None else (norm.weight, norm.eps),
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
            context = ids[:, -self.config.max_position_embeddings :]
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
