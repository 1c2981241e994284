"""Llama-family decoders (Llama 3.x, Qwen2.5) with Hugging Face checkpoint I/O.

Nothing here imports ``transformers``: checkpoints are read and written as config.json plus
safetensors files directly, and ``hf_causal_lm_loss`` (the chunked loss for a transformers causal LM) works
on the model it is given.
"""

from .config import PRESETS, LlamaConfig
from .hf_io import from_pretrained, load_hf_config, load_hf_weights, save_hf_checkpoint, save_pretrained
from .hf_loss import hf_causal_lm_loss
from .llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from .loss import chunked_cross_entropy

__all__ = [
    "PRESETS",
    "DecoderLayer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "chunked_cross_entropy",
    "from_pretrained",
    "hf_causal_lm_loss",
    "load_hf_config",
    "load_hf_weights",
    "save_hf_checkpoint",
    "save_pretrained",
]
