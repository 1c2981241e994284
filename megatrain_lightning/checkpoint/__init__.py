"""Streamed, atomic checkpoints of the engine's host state on any fsspec URL (local, s3://, memory://).

``ModelCheckpoint`` (the Lightning callback) is imported on first use: the engine saves through this
package and imports no Lightning."""

from typing import Any

from megatrain_lightning.checkpoint.hf import export_hf
from megatrain_lightning.checkpoint.store import (
    CheckpointError,
    is_checkpoint,
    load_trainer_state,
    remove,
    restore,
    save,
)

__all__ = [
    "CheckpointError",
    "ModelCheckpoint",
    "export_hf",
    "is_checkpoint",
    "load_trainer_state",
    "remove",
    "restore",
    "save",
]


def __getattr__(name: str) -> Any:
    if name == "ModelCheckpoint":
        from megatrain_lightning.checkpoint.callback import ModelCheckpoint

        return ModelCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
