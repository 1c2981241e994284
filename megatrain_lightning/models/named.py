"""A model named the way a user thinks of it: a preset (``"llama-3.1-8b"``), a Hugging Face ``config.json`` or
checkpoint directory, or a :class:`LlamaConfig`, with field overrides. No Lightning here: the planner, the CLI's
``plan`` and ``schedule`` and the Ray drivers resolve names too (the LightningModule re-exports it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatrain_lightning.models.config import PRESETS, LlamaConfig
from megatrain_lightning.models.hf_io import load_hf_config

_HEAD_SHAPE_FIELDS = ("hidden_size", "num_attention_heads")


def resolve_config(model: str | LlamaConfig, overrides: dict[str, Any] | None = None) -> LlamaConfig:
    """The :class:`LlamaConfig` named by a preset, a HF config.json / checkpoint dir, or given directly.

    Overriding ``hidden_size`` or ``num_attention_heads`` without ``head_dim`` re-derives ``head_dim``
    (a preset's head_dim would otherwise silently stay and no longer match the new width).
    """
    config = model if isinstance(model, LlamaConfig) else _load_named(model)
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"model overrides {unknown} are not LlamaConfig fields; valid fields: {', '.join(sorted(fields))}"
        )
    if "head_dim" not in overrides and any(k in overrides for k in _HEAD_SHAPE_FIELDS):
        overrides["head_dim"] = None
    return dataclasses.replace(config, **overrides)


def _load_named(model: str) -> LlamaConfig:
    if model.lower() in PRESETS:
        return LlamaConfig.from_preset(model)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_config(path)
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            return LlamaConfig.from_hf_dict(json.load(f))
    raise ValueError(
        f"model={model!r} is neither a preset nor an existing Hugging Face config.json or checkpoint directory; "
        f"presets: {', '.join(sorted(PRESETS))}"
    )
