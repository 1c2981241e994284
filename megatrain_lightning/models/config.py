"""Configuration of a Llama-family decoder (Llama 2/3.x, Qwen2/2.5) and its Hugging Face form.

The dataclass is the single source of truth for shapes: the model, the parameter count and the
config.json written next to a checkpoint are all derived from it. It reads and writes the
Hugging Face config.json dialects of both transformers 4.x (``rope_theta`` + ``rope_scaling``) and
5.x (``rope_parameters``), so checkpoints move between this package and ``transformers`` without
the latter being installed here.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Token ids are not needed to train but matter to whoever generates from a saved checkpoint
# (HF's LlamaConfig defaults bos/eos to 1/2, which is wrong for Llama 3), so they are carried along.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama/Qwen2 decoder-only language model."""

    vocab_size: int
    """Number of token ids; rows of ``embed_tokens`` and ``lm_head``."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP (gate/up output, down input)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Number of query heads."""
    num_key_value_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means one per query head."""
    head_dim: int | None = None
    """Width of one attention head; None means ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm square root."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: dict[str, Any] | None = None
    """None, or HF's llama3 form: rope_type="llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings."""
    max_position_embeddings: int = 2048
    """Longest context the model is meant for (``generate`` crops to it)."""
    attention_bias: bool | None = None
    """Bias on q/k/v projections (Qwen2 style; o_proj never has one). None: True for qwen2."""
    tie_word_embeddings: bool = False
    """``lm_head.weight`` is the very same Parameter as ``model.embed_tokens.weight``."""
    initializer_range: float = 0.02
    """Std of the normal init of every matrix."""
    model_type: Literal["llama", "qwen2"] = "llama"
    """Which HF architecture the checkpoint is written as."""
    loss_chunk_size: int = 4096
    """Tokens per chunk of the vocabulary loss, bounding its logits to chunk x vocab floats."""
    token_chunk_size: int | Literal["auto"] | None = "auto"
    """Tokens per tile of each decoder block (long context). Norms, projections, RoPE and the MLP run tile by
    tile, each tile recomputed in backward, so their intermediates exist for one tile at a time; only the
    attention core sees the whole sequence, and the final norm is folded into the chunked loss. "auto" sizes
    tiles from free device memory (models/tiling.py), leaving sequences shorter than one tile untiled (on
    the CPU: 8192 tokens). None: every block always sees the whole sequence at once."""
    tiled_attention: bool | Literal["auto"] = "auto"
    """Whether tiled blocks (``token_chunk_size``) also run the attention core over blocks of queries and keys
    (models/tiled_attention.py), in place of the fused kernel whose backward holds an fp32 dq accumulator of the
    whole sequence: slower, and up to a third less memory per token. "auto" does so when the fused kernel's
    backward would take over 3/4 of the free device memory (models/tiling.py; never on the CPU)."""
    token_ids: dict[str, Any] = field(default_factory=dict)
    """bos/eos/pad token ids read from a HF config, written back unchanged on save."""

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"
        if self.head_dim is None:
            self._check_positive("hidden_size", "num_attention_heads")
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; change one of them or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._validate()
        if self.token_chunk_size not in (None, "auto") and not (
            isinstance(self.token_chunk_size, int)
            and not isinstance(self.token_chunk_size, bool)
            and self.token_chunk_size > 0
        ):
            raise ValueError(f"token_chunk_size={self.token_chunk_size!r} must be a positive integer, 'auto' or None.")
        if self.tiled_attention not in (True, False, "auto"):
            raise ValueError(f"tiled_attention={self.tiled_attention!r}: choose True, False or 'auto'.")

    # ---------------------------------------------------------------- validation

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer.")

    def _validate(self) -> None:
        self._check_positive(
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "loss_chunk_size",
        )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention shares each "
                "kv head among a whole number of query heads, so pick a divisor."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of channels.")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0 and self.initializer_range >= 0):
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0, "
                f"initializer_range={self.initializer_range} must be >= 0."
            )
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type={self.model_type!r} is not one of {sorted(_ARCHITECTURES)}.")
        self._validate_bias()
        self._validate_rope_scaling()

    def _validate_bias(self) -> None:
        # HF's Qwen2 always has q/k/v bias and HF's Llama puts attention_bias on o_proj too, which
        # this model does not have: refuse the combinations whose checkpoints would not match.
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ValueError("model_type='qwen2' always has q/k/v bias; set attention_bias=True (or None).")
        if self.model_type == "llama" and self.attention_bias:
            raise ValueError(
                "attention_bias=True with model_type='llama' would need an o_proj bias in HF's Llama; "
                "use model_type='qwen2' for q/k/v-only bias."
            )

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) != "llama3":
            raise ValueError(f"rope_scaling={rs!r} is unsupported; use None or a dict with rope_type='llama3'.")
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in rs]
        if missing:
            raise ValueError(f"rope_scaling is missing {missing}; llama3 scaling needs {list(_LLAMA3_ROPE_KEYS)}.")
        if not rs["high_freq_factor"] > rs["low_freq_factor"]:
            raise ValueError(
                f"rope_scaling high_freq_factor={rs['high_freq_factor']} must exceed "
                f"low_freq_factor={rs['low_freq_factor']} (they bound the smoothing band)."
            )

    # ---------------------------------------------------------------- derived quantities

    def num_parameters(self) -> int:
        """Exact parameter count, tied embeddings counted once."""
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h  # two RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + h  # + final norm

    # ---------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from the contents of a HF config.json (transformers 4.x or 5.x dialect)."""
        model_type = d.get("model_type") or _model_type_from_architectures(d.get("architectures"))
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={model_type!r} is unsupported; expected one of {sorted(_ARCHITECTURES)}."
            )
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias", False):
            raise ValueError("Only SwiGLU MLPs without bias (hidden_act='silu', mlp_bias=False) are supported.")
        if model_type == "qwen2" and d.get("use_sliding_window", False):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is unsupported.")
        rope_theta, rope_scaling = _rope_from_hf(d)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            attention_bias=True if model_type == "qwen2" else d.get("attention_bias", False),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            initializer_range=d.get("initializer_range", 0.02),
            model_type=model_type,
            token_ids={k: d[k] for k in _TOKEN_ID_KEYS if d.get(k) is not None},
        )

    def to_hf_dict(self, dtype: torch.dtype | str = torch.float32) -> dict[str, Any]:
        """Contents of a HF config.json that ``transformers`` 4.x and 5.x both load."""
        dtype_name = str(dtype).removeprefix("torch.")
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling, "rope_type": "llama3", "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            # 4.x reads rope_theta/rope_scaling, 5.x prefers rope_parameters; writing both keeps
            # either version happy and they always agree.
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(rope_parameters),
            "rope_parameters": rope_parameters,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
            "use_cache": True,
            **self.token_ids,
        }
        if self.model_type == "llama":
            d.update(attention_bias=False, mlp_bias=False, attention_dropout=0.0)
        else:
            d.update(use_sliding_window=False, attention_dropout=0.0)
        return d

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A deep copy of ``PRESETS[name]`` with optional field overrides (e.g. loss_chunk_size).

        Overrides replace fields verbatim: head_dim keeps the preset's value unless overridden too.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}.")
        return dataclasses.replace(copy.deepcopy(PRESETS[key]), **overrides)


def _model_type_from_architectures(architectures: list[str] | None) -> str | None:
    for model_type, arch in _ARCHITECTURES.items():
        if architectures and arch in architectures:
            return model_type
    return None


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json dialect; rejects unsupported rope types."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_type={rope_type!r} is unsupported; only 'default' and 'llama3' are implemented.")
    scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_ROPE_KEYS}}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _llama31(hidden: int, intermediate: int, layers: int, heads: int, **kw: Any) -> LlamaConfig:
    kw.setdefault("rope_scaling", _llama3_rope(8.0))
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        model_type="llama",
        token_ids={"bos_token_id": 128000, "eos_token_id": 128001},
        **kw,
    )


def _qwen25(hidden: int, intermediate: int, layers: int, heads: int, kv: int, eps: float) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=152064,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=eps,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        model_type="qwen2",
        attention_bias=True,
        token_ids={"bos_token_id": 151643, "eos_token_id": 151643},
    )


# Shapes from the published config.json of each base model on the Hugging Face Hub (llama-120b aside).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": _llama31(2048, 8192, 16, 32, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True),
    "llama-3.1-8b": _llama31(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama31(8192, 28672, 80, 64),
    "llama-3.1-405b": _llama31(16384, 53248, 126, 128),  # 405.85B parameters
    # Not a published model: a Llama-3-shaped 117.91B (intermediate 3.5 x hidden) for planning 100B+ runs. 60
    # blocks rather than 61 (119.82B) so that it fits 512 GiB of host memory with Adam m + v on NVMe
    # (`megatrain plan --model llama-120b --host-mem 512GiB --nvme-dir DIR`: 510.5 GiB).
    "llama-120b": _llama31(12288, 43008, 60, 96),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 1e-6),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, 1e-5),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 1e-5),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, 1e-5),
    # Test sizes: a few hundred thousand parameters, fast on CPU.
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        loss_chunk_size=64,
    ),
    "tiny-qwen": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        model_type="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        loss_chunk_size=64,
    ),
}
