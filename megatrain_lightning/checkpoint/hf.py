"""Hugging Face layout: export the engine's current fp32 masters without a second copy of the model, and
describe, at save time, which model a checkpoint holds so that ``megatrain convert --to hf`` can write it."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatrain_lightning.checkpoint.stream import EngineView
from megatrain_lightning.models import LlamaForCausalLM, save_hf_checkpoint


def export_hf(
    engine: EngineView,
    model: LlamaForCausalLM,
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: Any = None,
) -> None:
    """Write config.json + sharded safetensors that ``transformers`` loads, from the masters of `model`
    (this project's Llama, somewhere inside the module the engine streams), in `dtype` (None: the masters'
    fp32, as ``megatrain convert --to hf`` writes). Tensors are cast one at a time, so memory beyond the
    model stays within one shard. `tokenizer` (the data module's) is written beside them for
    ``AutoTokenizer`` (:func:`~megatrain_lightning.models.save_hf_checkpoint`)."""
    prefix = _prefix_of(engine.model, model)
    save_hf_checkpoint(_named_masters(engine, prefix), model.config, directory, max_shard_bytes, dtype, tokenizer)


def _prefix_of(root: nn.Module, model: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is model:
            return f"{name}." if name else ""
    raise ValueError(f"{type(model).__name__} is not part of the module the engine streams")


def _named_masters(engine: EngineView, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    engine.flush()
    for unit in engine.all_units():
        for name, e in zip(engine.qualified_names(unit), unit.entries):
            if name.startswith(prefix):
                yield name[len(prefix) :], unit.master[e.offset : e.offset + e.numel].view(e.shape)


def describe_export(engine: EngineView) -> dict[str, Any] | None:
    """What ``megatrain convert --to hf`` needs, recorded in each checkpoint's index: the outermost model
    in the trained module that has a Hugging Face layout (this project's :class:`LlamaForCausalLM`, or
    a ``transformers`` ``PreTrainedModel``), the state-dict prefix of its parameters and its config.json.
    None when the module holds neither."""
    transformers = sys.modules.get("transformers")  # a transformers model means transformers is imported
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    for name, module in engine.model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, LlamaForCausalLM):
            return {
                "library": "megatrain",
                "prefix": prefix,
                "config": module.config.to_hf_dict(),
                "llama_config": dataclasses.asdict(module.config),
            }
        if pretrained is not None and isinstance(module, pretrained):
            return {"library": "transformers", "prefix": prefix, "config": _transformers_config(engine, module)}
    return None


def _transformers_config(engine: EngineView, model: nn.Module) -> dict[str, Any] | None:
    try:
        config = json.loads(model.config.to_json_string(use_diff=False))
    except (TypeError, ValueError, AttributeError):  # a config that does not serialize: no export
        return None
    config["architectures"] = [type(model).__name__]
    if any(model.config is c for c in getattr(engine, "_caches_off", [])):
        config["use_cache"] = True  # switched off for training only
    return config
