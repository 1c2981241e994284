"""Readers that race writers: a read of a checkpoint that a newer save replaced meanwhile starts over on
the new one, and is never reported as damage.

A save keeps the version its commit replaced (see :mod:`~megatrain_lightning.checkpoint.versions`), so a
reader that read the marker just before a commit still finds its data; only a read that outlives two
commits loses it. Every reader of :mod:`~megatrain_lightning.checkpoint.store` runs under
:func:`rereading`: when it fails and the marker changed since it started, it runs again on the new marker
(at most :data:`READ_ATTEMPTS` times); under an unchanged marker the failure is the checkpoint's own.
"""

from __future__ import annotations

import functools
import inspect
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from megatrain_lightning.checkpoint import stream
from megatrain_lightning.checkpoint.verify import FORMAT, CheckpointError, parse_marker, shown

T = TypeVar("T")


def named(fs: Any, path: str, url: str, previous: bool = False) -> set[str]:
    """The version the commit marker at `path` names (none without a marker), and with `previous` the one it
    replaced. (Read with a GET, not `exists`: object store listings are cached per filesystem object.)"""
    raw = _marker_raw(fs, path)
    if raw is None:
        return set()
    try:
        marker = parse_marker(raw)
    except (ValueError, UnicodeDecodeError, struct.error):
        raise CheckpointError(f"{url} is not a {FORMAT} commit marker; save to another path") from None
    return {v for v in (marker.get("data"), marker.get("previous") if previous else None) if v}


def filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


READ_ATTEMPTS = 5
"""How many times a read starts over on a newer checkpoint when saves keep replacing the one it reads."""


def reread_if_replaced(url: str, read: Callable[[], T], storage_options: dict[str, Any] | None = None) -> T:
    """``read()`` (a read of the checkpoint at `url`), run again when it fails because a save replaced the
    checkpoint meanwhile and its data went (see versions.py): the marker changed between the start of the
    read and the failure. A failure under an unchanged marker is the checkpoint's own, raised as it is."""
    fs, path = filesystem(url, storage_options)
    for _ in range(READ_ATTEMPTS):
        seen = _marker_raw(fs, path)
        try:
            return read()
        except (CheckpointError, stream.ShardError, OSError):
            if _marker_raw(fs, path) == seen:
                raise
    raise CheckpointError(
        f"{url} was replaced by newer saves {READ_ATTEMPTS} times while being read; read it again, or "
        "between saves (or raise megatrain_lightning.checkpoint.rereads.READ_ATTEMPTS)"
    )


def rereading(read: Callable[..., T]) -> Callable[..., T]:
    """`read(..., url, ..., pinned=None)` under :func:`reread_if_replaced`. With `pinned` (an index already
    read, whose version the read must use: the trainer state came from it) nothing is re-read; if that
    version went meanwhile, the error says so."""
    signature = inspect.signature(read)

    @functools.wraps(read)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        bound = signature.bind(*args, **kwargs).arguments
        url, pinned, options = bound["url"], bound.get("pinned"), bound.get("storage_options")
        if pinned is None or "data" not in pinned:  # (indexes written before they named their version)
            return reread_if_replaced(url, lambda: read(*args, **kwargs), options)
        try:
            return read(*args, **kwargs)
        except (CheckpointError, stream.ShardError, OSError):
            fs, path = filesystem(url, options)
            if pinned.get("data") in named(fs, path, url, previous=True):
                raise
            raise CheckpointError(
                f"{url} was replaced twice by newer saves while being resumed from, and the data of the "
                f"version read ({pinned.get('data')}) is gone; resume again"
            ) from None

    return wrapper


def _marker_raw(fs: Any, path: str) -> bytes | None:
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def pinned_version(url: str, pinned: dict, storage_options: dict[str, Any] | None) -> tuple[Any, str, dict]:
    """(filesystem, version directory, index) of the version `pinned`, an index read before, came from."""
    fs, path = filesystem(url, storage_options)
    return fs, f"{path}.d/{pinned['data']}", pinned


def raise_if_replaced(fs: Any, vdir: str) -> None:
    """A file of `vdir` is missing: if the marker no longer names `vdir`, a save replaced the checkpoint
    while it was being read (not damage)."""
    path, version = vdir.rsplit(".d/", 1)
    if version not in named(fs, path, shown(fs, path)):
        raise CheckpointError(
            f"{shown(fs, path)} was replaced by a newer save while being read ({shown(fs, vdir)} is gone); read it again"
        )
