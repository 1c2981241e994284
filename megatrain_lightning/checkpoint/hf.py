"""Export the engine's current fp32 masters in the Hugging Face layout, without a second copy of the model."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from torch import nn

from megatrain_lightning.engine.engine import StreamingEngine
from megatrain_lightning.models import LlamaForCausalLM, save_hf_checkpoint


def export_hf(
    engine: StreamingEngine,
    model: LlamaForCausalLM,
    directory: str | os.PathLike,
    dtype: torch.dtype | None = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json + sharded safetensors that ``transformers`` loads, from the masters of `model`
    (this project's Llama, somewhere inside the module the engine streams). Tensors are cast one at a
    time, so memory beyond the model stays within one shard."""
    prefix = _prefix_of(engine.model, model)
    save_hf_checkpoint(_named_masters(engine, prefix), model.config, directory, max_shard_bytes, dtype)


def _prefix_of(root: nn.Module, model: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is model:
            return f"{name}." if name else ""
    raise ValueError(f"{type(model).__name__} is not part of the module the engine streams")


def _named_masters(engine: StreamingEngine, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    engine.flush()
    for unit in engine.all_units():
        for name, e in zip(engine.qualified_names(unit), unit.entries):
            if name.startswith(prefix):
                yield name[len(prefix) :], unit.master[e.offset : e.offset + e.numel].view(e.shape)
