"""Lightning's ModelCheckpoint, able to find ``ckpt_path="last"`` on object stores and ``memory://``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from typing_extensions import override


class ModelCheckpoint(_LightningModelCheckpoint):
    """Same arguments and behaviour as Lightning's; use it when ``dirpath`` is a remote URL.

    Lightning finds ``last`` by listing ``dirpath`` with fsspec, which returns paths without their
    protocol (``bucket/run/last.ckpt``), and then resolves those bare paths on the local disk, where
    they do not exist: ``fit(ckpt_path="last")`` silently starts from scratch. This puts the protocol
    back. (An explicit URL, ``ckpt_path="s3://bucket/run/last.ckpt"``, works with either callback.)
    """

    @override
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        protocols = self._fs.protocol if isinstance(self._fs.protocol, tuple) else (self._fs.protocol,)
        if "file" in protocols or "local" in protocols:
            return found
        return {self._fs.unstrip_protocol(p) for p in found}
