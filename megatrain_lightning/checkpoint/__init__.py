"""Streamed, atomic checkpoints of the engine's host state on any fsspec URL (local, s3://, memory://)."""

from megatrain_lightning.checkpoint.callback import ModelCheckpoint
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
