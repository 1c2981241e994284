"""Checkpoints on any fsspec URL: streamed per unit, committed atomically, verified on load.

A checkpoint named ``<url>`` (for example ``s3://bucket/run/last.ckpt``) is::

    <url>                         commit marker: small JSON naming the data version (see below); written last
    <url>.d/<version>/index.json  units, parameter names/offsets/shapes/groups, checksums, optimizer steps
                                  and parameter order, tied-parameter aliases, the model to export
    <url>.d/<version>/units/NNNNN.safetensors   one shard per unit: fp32 master, exp_avg, exp_avg_sq
    <url>.d/<version>/buffers.safetensors       the model's persistent buffers
    <url>.d/<version>/trainer.pt                Lightning's trainer state (loops, schedulers, callbacks)
    <url>.d/<version>/lease.json                the lease of the save writing it (versions.py)

Each save writes a new version directory from the host buffers (never a second copy of the model),
then replaces the marker in one write (``os.replace`` locally, a single PUT on object stores). A save that
dies midway leaves the old marker and so the old checkpoint in force. The marker being a file also lets
Lightning find, date and delete checkpoints as it does its own.

Several writers and readers may share one checkpoint (two runs given the same path, a resume or a
conversion during a save). versions.py decides what a save deletes: only versions proven abandoned
(their writer's lease lapsed, or its process is gone) or older than the checkpoint the marker replaced,
which stays, for readers that read the marker just before a commit, until the next save begins. A read
that outlives even that finds its version gone: the readers here (:func:`read_index`,
:func:`read_checkpoint`, :func:`restore`) then re-read the marker and, when it moved on, start over on the
new checkpoint; a file missing under an unchanged marker is damage, reported as such. A resume restores
the weights of the version its trainer state came from (`pinned`), not whatever the marker names by then.

Durability. On a local filesystem every file of the version (shards, buffers, trainer.pt, index) is
fsynced, and the directories holding new entries, before the marker's temporary file is fsynced and
renamed over the marker; the marker's directory is fsynced last, so after a power loss the marker names
a version that is on disk whole (or the old marker stands). Object stores need no fsync: an object is
durable once its PUT returns, a single PUT is atomic, and S3 (like GCS and Azure Blob) is strongly
consistent read-after-write, so a reader that sees the new marker sees every object written before it.

The marker's JSON is framed as a tiny pickle whose only global is a sentence: ``torch.load`` (and so a
plain ``MyModule.load_from_checkpoint(path)`` or an ordinary strategy's resume) stops on it and prints
that the file is a sharded checkpoint, to be loaded with ``megatrain_lightning.load_from_checkpoint``
or converted with ``megatrain convert``. The pickle never runs anything (the "module" it names
cannot be imported). Markers that are bare JSON, as first written, are read all the same.
"""

from __future__ import annotations

import functools
import inspect
import io
import json
import os
import struct
import uuid
import warnings
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from megatrain_lightning.checkpoint import stream, versions
from megatrain_lightning.checkpoint.hf import describe_export
from megatrain_lightning.checkpoint.stream import EngineView

FORMAT = "megatrain-checkpoint"
VERSION = 1
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged or of another model; the message names path and fix."""


# What torch.load shows for a marker (no dots: a plain unpickler shows the text up to the first dot).
_TAG = "megatrain_lightning sharded checkpoint"
REFUSAL = (
    f"{_TAG} - torch and Lightning cannot load it directly; load it with "
    "load_from_checkpoint(YourModule, path) from megatrain_lightning, or convert it with: "
    "megatrain convert PATH --to torch OUT"
)
_PICKLE_HEAD = b"\x80\x02c"  # protocol 2, GLOBAL


# -- writing ----------------------------------------------------------------------------------------
def save(
    engine: EngineView,
    url: str,
    trainer_state: dict,
    *,
    optimizer: bool = True,
    param_groups: list[dict] | None = None,
    after_unit: Callable[[int], None] | None = None,
) -> None:
    """Write the engine's host state (masters, and Adam state when `optimizer`) and `trainer_state`."""
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        raise CheckpointError(f"{url} is a directory; a checkpoint path names a file (its data goes to {url}.d/)")
    versions.remove_unused(fs, path, keep=lambda: _named(fs, path, url))  # all but the current checkpoint
    lease = versions.Lease(fs, path, url)
    try:
        index_bytes = _write_version(engine, fs, lease, trainer_state, optimizer, param_groups, after_unit)
        replaced = _named(fs, path, url)
        marker = {"format": FORMAT, "version": VERSION, "data": lease.version, "index_crc32": zlib.crc32(index_bytes)}
        _commit(fs, path, {**marker, "previous": min(replaced, default=None)})
    except BaseException:
        if lease.version not in _named(fs, path, url):  # (a commit whose reply was lost stands)
            lease.release()
        raise
    lease.committed()
    # The checkpoint just replaced stays, for readers that read the marker before this commit.
    versions.remove_unused(fs, path, keep=lambda: _named(fs, path, url, previous=True))


def _write_version(
    engine: EngineView,
    fs: Any,
    lease: versions.Lease,
    trainer_state: dict,
    optimizer: bool,
    param_groups: list[dict] | None,
    after_unit: Callable[[int], None] | None,
) -> bytes:
    """Write the version directory: unit shards, buffers, trainer state, then the index (returned)."""
    vdir = lease.vdir
    engine.flush()
    if optimizer and engine.tier is not None:  # the moments are read ahead while earlier units are written
        held = [u for u in engine.all_units() if u.has_moments]
        engine.tier.plan([p for u in held for _ in range(2) for p in engine.tier.pieces(u)])  # m's pass, v's pass
    units = []
    for i, unit in enumerate(engine.all_units()):
        with_adam = optimizer and unit.has_moments
        tensors = [("master", unit.master)] + (list(_moments(unit, write=False).items()) if with_adam else [])
        info = stream.write(fs, f"{vdir}/units/{i:05d}.safetensors", tensors)
        units.append(_unit_record(engine, unit, i, info, with_adam))
        lease.beat()
        if after_unit is not None:
            after_unit(i)
    aliases = _aliases(engine)
    buffers = _buffers(engine, aliases)
    buf_info = stream.write(fs, f"{vdir}/buffers.safetensors", sorted(buffers.items()))
    raw = io.BytesIO()
    torch.save(trainer_state, raw)
    versions.write_bytes(fs, f"{vdir}/trainer.pt", raw.getvalue())
    index = {
        "format": FORMAT,
        "version": VERSION,
        "data": lease.version,
        "units": units,
        "buffers": buf_info,
        "param_groups": param_groups,
        "optimizer": optimizer,
        "param_order": _param_order(engine),
        "aliases": aliases,
        "export": _export(engine),
    }
    index_bytes = json.dumps(index, indent=1).encode()
    versions.write_bytes(fs, f"{vdir}/index.json", index_bytes)
    versions.sync_dirs(fs, [f"{vdir}/units", vdir])
    lease.beat()  # last: a lease lost meanwhile stops the commit
    return index_bytes


def _moments(unit: Any, write: bool) -> dict[str, Any]:
    """A unit's exp_avg and exp_avg_sq for a shard: its host tensors, or on the NVMe tier the moments
    streamed a piece at a time, m's pieces then v's (each piece read from its file; for a restore, `write`,
    filled from the shard and written back, so the host never holds a whole unit's moments)."""
    if unit.tier is None:
        return {"exp_avg": unit.m, "exp_avg_sq": unit.v}
    return {
        name: stream.Chunked(unit.numel, torch.float32, lambda k=k: (p[2 + k] for p in unit.moment_pieces(write=write)))
        for k, name in enumerate(("exp_avg", "exp_avg_sq"))
    }


def _unit_record(engine: EngineView, unit: Any, i: int, info: dict, with_adam: bool) -> dict:
    names = engine.qualified_names(unit)
    params = [
        {"name": n, "offset": e.offset, "shape": list(e.shape), "step": step, "group": e.group}
        for n, e, step in zip(names, unit.entries, unit.steps)
    ]
    return {"file": f"units/{i:05d}.safetensors", "numel": unit.numel, "adam": with_adam, "params": params, **info}


def _export(engine: EngineView) -> dict | None:
    try:
        return describe_export(engine)
    except Exception as err:  # a description must never fail a save
        warnings.warn(f"not recording the model for `megatrain convert --to hf`: {err}", stacklevel=3)
        return None


def _names_by_id(engine: EngineView) -> dict[int, str]:
    return {id(e.param): n for u in engine.all_units() for n, e in zip(engine.qualified_names(u), u.entries)}


def _param_order(engine: EngineView) -> list[str]:
    """The optimizer's parameters by name, in its group order: what torch.optim numbers its state by."""
    names = _names_by_id(engine)
    return [names[i] for i in engine.param_order]


def _aliases(engine: EngineView) -> dict[str, str]:
    """State-dict names of tied parameters besides their first (``lm_head.weight`` -> the embedding's)."""
    names = _names_by_id(engine)
    known = set(names.values())
    return {
        n: names[id(p)]
        for n, p in engine.model.named_parameters(remove_duplicate=False)
        if n not in known and id(p) in names
    }


def _buffers(engine: EngineView, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The model's persistent buffers (its state dict less the parameters, under any of their names)."""
    params = {name for unit in engine.all_units() for name in engine.qualified_names(unit)}
    params |= set(_aliases(engine) if aliases is None else aliases)
    state = engine.model.state_dict()
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in params}


def marker_bytes(marker: dict) -> bytes:
    """The commit marker's bytes: `marker` as JSON inside a pickle that torch.load refuses with REFUSAL."""
    body = json.dumps(marker).encode()
    # GLOBAL names "module" REFUSAL, attribute "ckpt": torch's weights-only refusal shows "REFUSAL.ckpt".
    return _PICKLE_HEAD + REFUSAL.encode() + b"\nckpt\nX" + struct.pack("<I", len(body)) + body + b"\x85R."


def parse_marker(raw: bytes) -> dict:
    """The JSON of a commit marker (framed as :func:`marker_bytes` writes it, or bare); ValueError if neither."""
    if raw.lstrip().startswith(b"{"):
        return json.loads(raw)
    if not raw.startswith(_PICKLE_HEAD):
        raise ValueError("not a commit marker")
    module_end = raw.index(b"\n", len(_PICKLE_HEAD))
    name_end = raw.index(b"\n", module_end + 1)
    if raw[name_end + 1 : name_end + 2] != b"X":
        raise ValueError("not a commit marker")
    (n,) = struct.unpack("<I", raw[name_end + 2 : name_end + 6])
    return json.loads(raw[name_end + 6 : name_end + 6 + n])


def _commit(fs: Any, path: str, marker: dict) -> None:
    data = marker_bytes(marker)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old marker or the new one
        versions.sync_dirs(fs, [os.path.dirname(path) or "."])  # ... and after a power loss, the new one
    else:
        fs.pipe_file(path, data)  # one object write: atomic on object stores


def _named(fs: Any, path: str, url: str, previous: bool = False) -> set[str]:
    """The version the commit marker at `path` names (none without a marker), and with `previous` the one it
    replaced. (Read with a GET, not `exists`: object store listings are cached per filesystem object.)"""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return set()
    try:
        marker = parse_marker(raw)
    except (ValueError, UnicodeDecodeError, struct.error):
        raise CheckpointError(f"{url} is not a {FORMAT} commit marker; save to another path") from None
    return {v for v in (marker.get("data"), marker.get("previous") if previous else None) if v}


def remove(url: str) -> None:
    """Delete a checkpoint: the marker first (so it stops existing), then its data, but not a version that a
    save to the same name is writing now."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    versions.remove_unused(fs, path, keep=set, warn=False)
    versions.drop_if_empty(fs, f"{path}.d")


# -- reading ----------------------------------------------------------------------------------------
READ_ATTEMPTS = 5
"""How many times a read starts over on a newer checkpoint when saves keep replacing the one it reads."""


def reread_if_replaced(url: str, read: Callable[[], T]) -> T:
    """``read()`` (a read of the checkpoint at `url`), run again when it fails because a save replaced the
    checkpoint meanwhile and its data went (see versions.py): the marker changed between the start of the
    read and the failure. A failure under an unchanged marker is the checkpoint's own, raised as it is."""
    fs, path = fsspec.core.url_to_fs(url)
    for _ in range(READ_ATTEMPTS):
        seen = _marker_raw(fs, path)
        try:
            return read()
        except (CheckpointError, stream.ShardError, OSError):
            if _marker_raw(fs, path) == seen:
                raise
    raise CheckpointError(
        f"{url} was replaced by newer saves {READ_ATTEMPTS} times while being read; read it again, or "
        "between saves (or raise megatrain_lightning.checkpoint.store.READ_ATTEMPTS)"
    )


def _rereading(read: Callable[..., T]) -> Callable[..., T]:
    """`read(..., url, ..., pinned=None)` under :func:`reread_if_replaced`. With `pinned` (an index already
    read, whose version the read must use: the trainer state came from it) nothing is re-read; if that
    version went meanwhile, the error says so."""
    signature = inspect.signature(read)

    @functools.wraps(read)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        bound = signature.bind(*args, **kwargs).arguments
        url, pinned = bound["url"], bound.get("pinned")
        if pinned is None or "data" not in pinned:  # (indexes written before they named their version)
            return reread_if_replaced(url, lambda: read(*args, **kwargs))
        try:
            return read(*args, **kwargs)
        except (CheckpointError, stream.ShardError, OSError):
            fs, path = fsspec.core.url_to_fs(url)
            if pinned.get("data") in _named(fs, path, url, previous=True):
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


def _pinned_version(url: str, pinned: dict) -> tuple[Any, str, dict]:
    """(filesystem, version directory, index) of the version `pinned`, an index read before, came from."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, f"{path}.d/{pinned['data']}", pinned


def _raise_if_replaced(fs: Any, vdir: str, url: str) -> None:
    """A file of `vdir` is missing: if the marker no longer names `vdir`, a save replaced the checkpoint
    while it was being read (not damage)."""
    path, version = vdir.rsplit(".d/", 1)
    if version not in _named(fs, path, url):
        raise CheckpointError(f"{url} was replaced by a newer save while being read ({vdir} is gone); read it again")


def is_checkpoint(url: str) -> bool:
    """Whether `url` is a commit marker of this format (a Lightning .ckpt file is not)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.isfile(path):
        return False
    try:
        with fs.open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:  # removed meanwhile (by another process sharing the directory)
        return False
    if head.startswith(_PICKLE_HEAD):
        return _TAG.encode() in head[:200] and FORMAT.encode() in head
    return head.lstrip().startswith(b"{") and FORMAT.encode() in head


@_rereading
def read_index(url: str) -> tuple[Any, str, dict]:
    """(filesystem, version directory, index) of the committed checkpoint at `url`."""
    fs, path = fsspec.core.url_to_fs(url)
    marker = _pointer(fs, path, url)
    vdir = f"{path}.d/{marker['data']}"
    try:
        raw = fs.cat_file(f"{vdir}/index.json")
    except FileNotFoundError:
        raise CheckpointError(
            f"{url}: the index {vdir}/index.json is missing, so the checkpoint is damaged; "
            "resume from an earlier checkpoint"
        ) from None
    if zlib.crc32(raw) != marker["index_crc32"]:
        raise CheckpointError(
            f"{url}: {vdir}/index.json does not match its commit marker; resume from an earlier checkpoint"
        )
    return fs, vdir, json.loads(raw)


def load_trainer_state(url: str) -> dict:
    return read_checkpoint(url)[0]


@_rereading
def read_checkpoint(url: str) -> tuple[dict, dict]:
    """(Lightning trainer state, index) of the committed checkpoint at `url`, the marker read once."""
    fs, vdir, index = read_index(url)
    with fs.open(f"{vdir}/trainer.pt", "rb") as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False), index


@_rereading
def restore(engine: EngineView, url: str, *, optimizer: bool, pinned: dict | None = None) -> dict:
    """Stream masters (and Adam state when `optimizer`) into the engine's host buffers; returns the index.
    `pinned`: the index read with the trainer state (read_checkpoint), whose version to restore."""
    fs, vdir, index = _pinned_version(url, pinned) if pinned and "data" in pinned else read_index(url)
    _check_layout(engine, index, url)
    if optimizer and not index["optimizer"]:
        raise CheckpointError(f"{url} holds weights only (save_weights_only=True); it cannot resume training")
    engine.flush()
    for unit, rec in zip(engine.all_units(), index["units"]):
        adam = optimizer and rec["adam"]
        targets = {"master": unit.master, **(_moments(unit, write=True) if adam else {})}
        try:
            stream.read_into(fs, f"{vdir}/{rec['file']}", targets, rec)
        except stream.ShardError as err:
            raise CheckpointError(f"{err}; resume from an earlier checkpoint") from None
        if optimizer:
            unit.steps = [param_step(rec, p) if rec["adam"] else 0 for p in rec["params"]]
    _restore_buffers(engine, fs, vdir, index, url)
    engine.refresh_from_masters()
    return index


def read_unit(fs: Any, vdir: str, rec: dict, url: str, *, adam: bool = False) -> dict[str, torch.Tensor]:
    """One unit's flat fp32 tensors, fresh: ``master``, plus ``exp_avg``/``exp_avg_sq`` when `adam` and
    the unit holds them; the whole shard is checksummed (tensors not asked for are read and dropped)."""
    targets = {"master": torch.empty(rec["numel"], dtype=torch.float32)}
    if adam and rec["adam"]:
        targets.update(exp_avg=torch.empty(rec["numel"]), exp_avg_sq=torch.empty(rec["numel"]))
    try:
        stream.read_into(fs, f"{vdir}/{rec['file']}", targets, rec)
    except (stream.ShardError, FileNotFoundError) as err:
        _raise_if_replaced(fs, vdir, url)
        raise CheckpointError(f"{url}: {err}; use an earlier checkpoint") from None
    return targets


def read_buffers(fs: Any, vdir: str, index: dict, url: str) -> dict[str, torch.Tensor]:
    """The model's buffers as saved (checksummed)."""
    try:
        return stream.read_tensors(fs, f"{vdir}/buffers.safetensors", index["buffers"])
    except (stream.ShardError, FileNotFoundError) as err:
        _raise_if_replaced(fs, vdir, url)
        raise CheckpointError(f"{url}: {err}; use an earlier checkpoint") from None


def _restore_buffers(engine: EngineView, fs: Any, vdir: str, index: dict, url: str) -> None:
    current = _buffers(engine)
    if not current:
        return
    loaded = {k: torch.empty_like(v) for k, v in current.items()}
    stream.read_into(fs, f"{vdir}/buffers.safetensors", loaded, index["buffers"])
    engine.model.load_state_dict(loaded, strict=False)


def _check_layout(engine: EngineView, index: dict, url: str) -> None:
    units = engine.all_units()
    if len(units) != len(index["units"]):
        raise CheckpointError(
            f"{url} has {len(index['units'])} parameter units, this model has {len(units)}: "
            "it was saved from a model of another shape; resume with the same model configuration"
        )
    for unit, rec in zip(units, index["units"]):
        for name, e, saved in zip(engine.qualified_names(unit), unit.entries, rec["params"]):
            if saved["name"] != name or saved["shape"] != list(e.shape) or saved["offset"] != e.offset:
                raise CheckpointError(
                    f"{url}: parameter {saved['name']} {saved['shape']} does not match this model's {name} "
                    f"{list(e.shape)}: it was saved from a model of another shape; resume with the same configuration"
                )


def _pointer(fs: Any, path: str, url: str) -> dict:
    try:
        marker = parse_marker(fs.cat_file(path))
    except FileNotFoundError:
        raise CheckpointError(
            f"no checkpoint at {url}: its commit marker is missing (never saved, or the save was interrupted)"
        ) from None
    except (ValueError, UnicodeDecodeError, struct.error):  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{url} is not a {FORMAT} commit marker") from None
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{url}: unsupported checkpoint format {marker.get('format')} v{marker.get('version')}")
    return marker


def param_step(unit_record: dict, param_record: dict) -> int:
    """A parameter's Adam step count; indexes written before steps were kept per parameter have one per unit."""
    return param_record.get("step", unit_record.get("step", 0))
