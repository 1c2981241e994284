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
new checkpoint (rereads.py); a file missing under an unchanged marker is damage, reported as such. A resume restores
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

:func:`save` and :func:`restore` run over the engine's ranks (engine/ranks.py), one path for any number:
with one rank (the ordinary case) every agreement between ranks is the rank's own and every unit is written
and read whole, straight from and into its buffers. With several they are collective: every rank calls them,
in the same order. The files are the ones a single process writes (each
unit whole), so nothing in a checkpoint depends on the number of ranks: saved with 2 ranks, it resumes with
1 or 3, and ``megatrain convert`` or ``load_from_checkpoint`` read it in one process. Unit i is written by
rank i % W, straight to the URL, its shards swapped to it a tensor at a time (ranks.py: no rank holds more
than one tensor of one unit whole, none the model); rank 0 alone takes the lease, hands the version's name
to the others, writes buffers, trainer.pt and the index (its file records and per-parameter steps come
from the other ranks in one all-reduce of integers) and commits only after every rank's writes succeeded.
A rank that fails makes every rank raise, with no commit: the previous checkpoint stays in force. A
restore reads on every rank the version rank 0 reads (checked), each rank keeping its own shard of each
unit file, and raises on every rank when any rank fails; it does not start over on a newer checkpoint,
which one rank alone might see.

Why one file: saving and restoring, in one process or on W ranks, are one protocol (lease, write, commit;
pin, read, check) with the ranks' agreements between its steps; the agreements and the swaps of shards
are in ranks.py.

Reading trusts nothing it has not checked (:mod:`~megatrain_lightning.checkpoint.verify` says what and
how a failure reads; :mod:`~megatrain_lightning.checkpoint.trust` how ``trainer.pt`` is unpickled).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import struct
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from fsspec.implementations.local import LocalFileSystem

from megatrain_lightning.checkpoint import ranks, stream, trust, versions
from megatrain_lightning.checkpoint.hf import describe_export
from megatrain_lightning.checkpoint.rereads import (  # noqa: F401  (READ_ATTEMPTS, reread_if_replaced: this module's API too)
    READ_ATTEMPTS,
    raise_if_replaced,
    reread_if_replaced,
    rereading,
)
from megatrain_lightning.checkpoint.rereads import filesystem as _filesystem
from megatrain_lightning.checkpoint.rereads import named as _named
from megatrain_lightning.checkpoint.rereads import pinned_version as _pinned_version
from megatrain_lightning.checkpoint.stream import EngineView
from megatrain_lightning.checkpoint.verify import (  # noqa: F401  (REFUSAL, parse_marker: this module's API too)
    FORMAT,
    REFUSAL,
    VERSION,
    VERSION_NAME,
    CheckpointError,
    damaged,
    index_invalid,
    index_lacks,
    load_json,
    looks_like_marker,
    marker_bytes,
    parse_marker,
    shown,
)

T = TypeVar("T")


# -- writing ----------------------------------------------------------------------------------------
def save(
    engine: EngineView,
    url: str,
    trainer_state: dict,
    *,
    optimizer: bool = True,
    param_groups: list[dict] | None = None,
    after_unit: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    weights: Callable[[Any], torch.Tensor] | None = None,
) -> None:
    """Write the engine's host state (masters, and Adam state when `optimizer`) and `trainer_state`;
    `storage_options` go to fsspec (credentials, endpoint) and are written nowhere. `weights(unit)`: the flat
    fp32 weights to write in place of a unit's master (a weight average that a callback put in the
    checkpoint's state dict); the Adam state stays the master's.

    Every rank of the engine's ``ranks`` calls this at once (one, in one process): rank 0 takes the lease and
    hands the others the version's name, every rank writes its units (ranks.py; with one rank, all of them,
    each straight from its buffers), rank 0 writes the rest and commits once every rank's writes succeeded.
    Any rank failing: no commit, and every rank raises. With several ranks `weights(unit)` is this rank's
    shard of the unit's weights, and `after_unit(i)` runs on unit i's writer."""
    part = engine.ranks
    fs, path = _filesystem(url, storage_options)
    doing, kept = f"saving {url}", "nothing was committed: the previous checkpoint stands"
    lease, error = None, None
    if part.rank == 0:
        try:
            lease = _begin(fs, path, url)
        except Exception as err:  # (told to the other ranks by the missing version name)
            error = err
    version = ranks.share_text(part, None if lease is None else lease.version)
    if version is None:
        if error is not None:
            raise error
        raise CheckpointError(f"{doing}: rank 0 could not begin it (its own error says why); {kept}")
    vdir = f"{path}.d/{version}"

    def write(i: int, tensors: list) -> dict:
        info = stream.write(fs, f"{vdir}/units/{i:05d}.safetensors", tensors)
        if lease is not None:
            lease.beat()
        if after_unit is not None:
            after_unit(i)
        return info

    try:
        units, shards, torch_optimizers = engine.all_units(), [], None
        try:
            engine.flush()  # (a host job's error surfaces here)
            torch_optimizers = _torch_optimizers(engine) if optimizer else None  # (refused before anything is written)
            _plan_moment_reads(engine, units, optimizer)
            shards = [_unit_tensors(u, optimizer, weights) for u in units]
        except Exception as err:
            error = err
        ranks.settle(part, error, doing, kept)  # every rank is ready to swap shards, or every rank raises
        steps, files = ranks.settle_books(part, units, *ranks.write_units(part, units, shards, write), doing, kept)
        if lease is not None:
            try:
                records = [
                    _unit_record(engine, u, i, files[i], optimizer and u.has_moments, steps[i])
                    for i, u in enumerate(units)
                ]
                index_bytes = _write_books(
                    engine, fs, lease, records, trainer_state, optimizer, param_groups, torch_optimizers
                )
                _commit_version(fs, path, url, lease, index_bytes)
            except Exception as err:  # (told to every rank by the settle below)
                error = err
        ranks.settle(part, error, doing, kept)
    except BaseException:
        if lease is not None:
            _abandon(fs, path, url, lease)
        raise
    if lease is not None:
        _committed(fs, path, url, lease)


def _begin(fs: Any, path: str, url: str) -> versions.Lease:
    """The lease of a new version directory, after removing the versions no one needs."""
    if fs.isdir(path):
        raise CheckpointError(f"{url} is a directory; a checkpoint path names a file (its data goes to {url}.d/)")
    stranger = versions.foreign(fs, path)
    if stranger is not None:  # saves delete versions there: never through a link, never beside others' files
        raise CheckpointError(
            f"saving {url}: {url}.d {stranger}; a checkpoint's data directory must be a real directory holding "
            f"only the version directories its saves write; move what is not a save's out of {url}.d (or "
            "replace the link with its target), or save to another path"
        )
    versions.remove_unused(fs, path, keep=lambda: _named(fs, path, url))  # all but the current checkpoint
    return versions.Lease(fs, path, url)


def _commit_version(fs: Any, path: str, url: str, lease: versions.Lease, index_bytes: bytes) -> None:
    replaced = _named(fs, path, url)
    marker = {"format": FORMAT, "version": VERSION, "data": lease.version, "index_crc32": zlib.crc32(index_bytes)}
    _commit(fs, path, {**marker, "previous": min(replaced, default=None)})


def _abandon(fs: Any, path: str, url: str, lease: versions.Lease) -> None:
    if lease.version not in _named(fs, path, url):  # (a commit whose reply was lost stands)
        lease.release()


def _committed(fs: Any, path: str, url: str, lease: versions.Lease) -> None:
    lease.committed()
    # The checkpoint just replaced stays, for readers that read the marker before this commit.
    versions.remove_unused(fs, path, keep=lambda: _named(fs, path, url, previous=True))


def _plan_moment_reads(engine: EngineView, units: list, optimizer: bool) -> None:
    """On the NVMe tier, the moments of the units written whole here are read ahead while earlier units are
    written (m's pass, then v's, as the file writer takes them); a partitioned unit's shard is read when its
    swap takes it (:class:`_TierShards`)."""
    whole = [u for u in units if not u.partitioned]
    if optimizer and engine.tier is not None and whole:
        held = [u for u in whole if u.has_moments]
        engine.tier.plan([p for u in held for _ in range(2) for p in engine.tier.pieces(u)])


def _unit_tensors(unit: Any, optimizer: bool, weights: Callable[[Any], torch.Tensor] | None) -> Mapping[str, Any]:
    """The tensors of unit's file as this rank holds them, by name in file order: a whole unit's, taken when
    its file is written (:class:`_WholeTensors`), or this rank's shards of a partitioned unit's, taken now
    (ranks.py swaps them)."""
    adam = optimizer and unit.has_moments
    if not unit.partitioned:
        return _WholeTensors(unit, adam, weights)
    master = unit.master if weights is None else weights(unit)
    if not adam:
        return {"master": master}
    if unit.tier is not None:
        return _TierShards(unit, master)
    return {"master": master, "exp_avg": unit.m, "exp_avg_sq": unit.v}


def _torch_optimizers(engine: EngineView) -> tuple[list, list] | None:
    """The state of the optimizers that step themselves (engine/generic_optim.py): (tensors, JSON), or None."""
    generic = getattr(engine, "generic", None)
    return None if generic is None else generic.saved_state()


def _write_books(
    engine: EngineView,
    fs: Any,
    lease: versions.Lease,
    units: list[dict],
    trainer_state: dict,
    optimizer: bool,
    param_groups: list[dict] | None,
    torch_optimizers: tuple[list, list] | None = None,
) -> bytes:
    """Buffers, trainer state, then the index over the unit files' records `units` (returned). `torch_optimizers`:
    the state of optimizers that step themselves, as (tensors for ``optimizer.safetensors``, JSON for the index)."""
    vdir = lease.vdir
    aliases = _aliases(engine)
    buffers = _buffers(engine, aliases)
    buf_info = stream.write(fs, f"{vdir}/buffers.safetensors", sorted(buffers.items()))
    raw = io.BytesIO()
    torch.save(trainer_state, raw)
    trainer_bytes = raw.getvalue()
    versions.write_bytes(fs, f"{vdir}/trainer.pt", trainer_bytes)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "data": lease.version,
        "units": units,
        "buffers": buf_info,
        "trainer": {"bytes": len(trainer_bytes), "crc32": zlib.crc32(trainer_bytes)},  # checked before unpickling
        "param_groups": param_groups,
        "optimizer": optimizer,
        "param_order": _param_order(engine),
        "aliases": aliases,
        "export": _export(engine),
    }
    if torch_optimizers is not None:
        tensors, meta = torch_optimizers
        info = stream.write(fs, f"{vdir}/{TORCH_OPTIMIZERS}", tensors)
        index["torch_optimizers"] = {**info, "state": meta}
    index_bytes = json.dumps(index, indent=1).encode()
    versions.write_bytes(fs, f"{vdir}/index.json", index_bytes)
    versions.sync_dirs(fs, [f"{vdir}/units", vdir])
    lease.beat()  # last: a lease lost meanwhile stops the commit
    return index_bytes


class _TierShards(Mapping):
    """A partitioned unit's shards for a save (ranks.py) when its moments are on the NVMe tier: each moment
    read from the unit's file when the swap takes it, so a rank holds one unit's shard of one at a time."""

    def __init__(self, unit: Any, master: torch.Tensor) -> None:
        self.unit, self.master = unit, master

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "master":
            return self.master
        k = ("exp_avg", "exp_avg_sq").index(name)
        out = torch.empty(self.unit.numel)
        for lo, hi, *mv in self.unit.moment_pieces(write=False):
            out[lo:hi].copy_(mv[k])
        return out

    def __contains__(self, name: object) -> bool:  # (without reading anything)
        return name in ("master", "exp_avg", "exp_avg_sq")

    def __iter__(self) -> Iterator[str]:
        return iter(("master", "exp_avg", "exp_avg_sq"))

    def __len__(self) -> int:
        return 3


class _WholeTensors(Mapping):
    """A whole unit's file tensors for a save, each taken when the file writer comes to it: the master (or
    `weights(unit)`), then with `adam` the moments (on the NVMe tier streamed a piece at a time: :func:`_moments`)."""

    def __init__(self, unit: Any, adam: bool, weights: Callable[[Any], torch.Tensor] | None) -> None:
        self.unit, self.weights = unit, weights
        self.names = ("master", "exp_avg", "exp_avg_sq") if adam else ("master",)

    def __getitem__(self, name: str) -> Any:
        if name == "master":
            return self.unit.master if self.weights is None else self.weights(self.unit)
        return _moments(self.unit, write=False)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


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


def _unit_record(
    engine: EngineView, unit: Any, i: int, info: dict, with_adam: bool, steps: list[int] | None = None
) -> dict:
    """The index's record of unit i: its file, and its whole parameters with their optimizer `steps` (by
    default this process's own, which holds every piece of an unpartitioned unit)."""
    names = engine.qualified_names(unit)
    steps = ranks.layout_steps(unit) if steps is None else steps
    params = [
        {"name": n, "offset": e.offset, "shape": list(e.shape), "step": step, "group": e.group}
        for n, e, step in zip(names, unit.layout, steps)
    ]
    numel = unit.full_numel
    return {"file": f"units/{i:05d}.safetensors", "numel": numel, "adam": with_adam, "params": params, **info}


def _export(engine: EngineView) -> dict | None:
    try:
        return describe_export(engine)
    except Exception as err:  # a description must never fail a save
        warnings.warn(f"not recording the model for `megatrain convert --to hf`: {err}", stacklevel=3)
        return None


def _names_by_id(engine: EngineView) -> dict[int, str]:
    return {id(e.param): n for u in engine.all_units() for n, e in zip(engine.qualified_names(u), u.layout)}


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
    # (partitioned, a block's state_dict() is refused: no rank holds its parameters whole)
    state = engine.model.state_dict() if engine.ranks.whole_here else engine.persistent_buffers()
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in params}


def _commit(fs: Any, path: str, marker: dict) -> None:
    data = marker_bytes(marker)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        versions.write_bytes(fs, tmp, data)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old marker or the new one
        versions.sync_dirs(fs, [os.path.dirname(path) or "."])  # ... and after a power loss, the new one
    else:
        fs.pipe_file(path, data)  # one object write: atomic on object stores


def remove(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete a checkpoint: the marker first (so it stops existing), then its data, but not a version that a
    save to the same name is writing now."""
    fs, path = _filesystem(url, storage_options)
    try:
        fs.rm(path)
    except FileNotFoundError:
        pass
    versions.remove_unused(fs, path, keep=set, warn=False)
    versions.drop_if_empty(fs, f"{path}.d")


# -- reading ----------------------------------------------------------------------------------------
# Every reader below checks before it trusts: the marker's JSON, index.json against the marker's CRC32,
# each shard and trainer.pt against the index's. What fails is one CheckpointError line naming the file,
# what is wrong with it, and the intact checkpoints saved earlier in the same directory.
def is_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether `url` is a checkpoint of this format, intact or not (a Lightning .ckpt file is not): its
    marker starts as ours do, or its data directory ``<url>.d/`` exists (a damaged or lost marker)."""
    fs, path = _filesystem(url, storage_options)
    if fs.isfile(path):
        try:
            with fs.open(path, "rb") as f:
                if looks_like_marker(f.read(4096)):
                    return True
        except FileNotFoundError:  # removed meanwhile (by another process sharing the directory)
            pass
    return fs.isdir(f"{path}.d")


def _index(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str, dict]:
    """(filesystem, version directory, index) of the committed checkpoint at `url` (read once: the public
    :func:`read_index` and the readers that start from it re-read a checkpoint replaced meanwhile)."""
    fs, path = _filesystem(url, storage_options)
    marker = _pointer(fs, path, url)
    vdir = f"{path}.d/{marker['data']}"
    file = f"{vdir}/index.json"
    try:
        raw = fs.cat_file(file)
    except FileNotFoundError:
        if not fs.isdir(f"{path}.d"):
            why = f"{shown(fs, path)}.d, the checkpoint's data directory, is missing"
        elif not fs.isdir(vdir):  # dated by the data that is there, not by the version named
            why = f"{shown(fs, path)}: its marker names version {marker['data']}, which {shown(fs, path)}.d lacks"
            raise damaged(fs, None, why, path) from None
        else:
            why = f"the index {shown(fs, file)} is missing"
        raise damaged(fs, vdir, why) from None
    if zlib.crc32(raw) != marker["index_crc32"]:
        raise damaged(
            fs, vdir, f"{shown(fs, file)} does not match the checksum in its commit marker (altered or damaged)"
        )
    try:
        index = load_json(raw)
    except ValueError as err:
        why = f": {err}" if "nests deeper" in str(err) else " is not JSON"
        raise damaged(fs, vdir, f"{shown(fs, file)}{why}") from None
    lacking = index_lacks(index)
    if lacking:
        raise damaged(fs, vdir, f"{shown(fs, file)} lacks {lacking}: it is not an index this version can read")
    invalid = index_invalid(index)
    if invalid:
        raise damaged(fs, vdir, f"{shown(fs, file)}: {invalid}: the index is damaged or altered")
    return fs, vdir, index


read_index = rereading(_index)


def load_trainer_state(url: str, storage_options: dict[str, Any] | None = None) -> dict:
    return read_checkpoint(url, storage_options)[0]


@rereading
def read_checkpoint(url: str, storage_options: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """(Lightning trainer state, index) of the committed checkpoint at `url`, the marker read once."""
    fs, vdir, index = _index(url, storage_options)
    return read_trainer_state(fs, vdir, index), index


def read_trainer_state(fs: Any, vdir: str, index: dict) -> dict:
    """trainer.pt, checked against the index's checksum and then unpickled by torch's restricted unpickler
    (see :mod:`megatrain_lightning.checkpoint.trust`): never anything that could run code."""
    file = f"{vdir}/trainer.pt"
    try:
        raw = fs.cat_file(file)
    except FileNotFoundError:
        raise damaged(fs, vdir, f"{shown(fs, file)}, the trainer state, is missing") from None
    expect = index.get("trainer")  # None: written before the index recorded it
    if expect is not None and (len(raw), zlib.crc32(raw)) != (expect.get("bytes"), expect.get("crc32")):
        raise damaged(
            fs,
            vdir,
            f"{shown(fs, file)} has {len(raw)} bytes with checksum {zlib.crc32(raw):#010x}, the index recorded "
            f"{expect.get('bytes')} with {expect.get('crc32', 0):#010x}: the trainer state is truncated or altered",
        )
    try:
        state = trust.load_restricted(raw)
    except trust.RefusedGlobal as err:
        raise damaged(fs, vdir, trust.refusal(shown(fs, file), err.name)) from None
    except ValueError as err:
        raise damaged(fs, vdir, f"{shown(fs, file)} is {err}") from None
    if not isinstance(state, dict):
        raise damaged(fs, vdir, f"{shown(fs, file)} holds a {type(state).__name__}, not a trainer state")
    return state


def restore(
    engine: EngineView,
    url: str,
    *,
    optimizer: bool,
    pinned: dict | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict:
    """Stream masters (and Adam state when `optimizer`) into the engine's host buffers; returns the index.
    `pinned`: the index read with the trainer state (read_checkpoint), whose version to restore.

    Every rank of the engine's ``ranks`` calls this at once (one, in one process) and reads its shard of each
    unit (with one rank, the whole unit); a rank failing makes every rank raise. Only one rank may start over
    on a newer checkpoint (rereads.py): of several, one alone might see it, and the ranks would part."""
    read = _restore_rereading if ranks.may_reread(engine.ranks) else _restore
    return read(engine, url, optimizer=optimizer, pinned=pinned, storage_options=storage_options)


def _restore(
    engine: EngineView,
    url: str,
    *,
    optimizer: bool,
    pinned: dict | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict:
    """:func:`restore` on every rank at once: each reads the same version (checked) and keeps its shards; the
    outer re-upload (refresh_from_masters) is collective, so every rank reaches it, or every rank raises."""
    part = engine.ranks
    doing, state = f"restoring {url}", "this engine's state is not restored"
    fs, vdir, index, error = None, "", {}, None
    try:
        fs, vdir, index = _version_to_restore(url, pinned, storage_options)
    except Exception as err:  # (told to every rank by the settle below)
        error = err
    ranks.settle(part, error, doing, state, tag=zlib.crc32(vdir.rsplit("/", 1)[-1].encode()))
    _check_restorable(engine, index, url, fs, vdir, optimizer)  # (the same index on every rank: the same outcome)
    units = engine.all_units()
    scratch = ranks.scratch_for(units)
    try:
        engine.flush()
        for unit, rec in zip(units, index["units"]):
            _read_unit(fs, vdir, unit, rec, optimizer, scratch)
            if optimizer:
                unit.steps = ranks.piece_steps(unit, _saved_steps(rec))
        _restore_buffers(engine, fs, vdir, index)
        if optimizer:
            _restore_torch_optimizers(engine, fs, vdir, index, url)
    except Exception as err:
        error = err
    ranks.settle(part, error, doing, state)
    engine.refresh_from_masters()
    return index


_restore_rereading = rereading(_restore)


def _read_unit(fs: Any, vdir: str, unit: Any, rec: dict, optimizer: bool, scratch: torch.Tensor | None) -> None:
    """Unit `unit`'s file into its buffers: a whole unit's tensors straight into them (on the NVMe tier the
    moments a piece at a time), a partitioned unit's own shard of each, the rest passing through `scratch`."""
    adam = optimizer and rec["adam"]
    if not unit.partitioned:
        targets = {"master": unit.master, **(_moments(unit, write=True) if adam else {})}
        _read_file(fs, vdir, rec["file"], targets, rec)
        return
    names = ["master", "exp_avg", "exp_avg_sq"] if rec["adam"] else ["master"]
    mine = {"master": unit.master}
    tier = adam and unit.tier is not None  # (read here, then written to its files)
    if adam:
        m, v = (torch.empty(unit.numel), torch.empty(unit.numel)) if tier else (unit.m, unit.v)
        mine.update(exp_avg=m, exp_avg_sq=v)
    _read_file(fs, vdir, rec["file"], ranks.shard_targets(unit, names, mine, scratch), rec)
    for lo, hi, m, v in unit.moment_pieces(fresh=True) if tier else ():
        m.copy_(mine["exp_avg"][lo:hi])
        v.copy_(mine["exp_avg_sq"][lo:hi])


TORCH_OPTIMIZERS = "optimizer.safetensors"  # the tensors of the optimizers that step themselves


def _restore_torch_optimizers(engine: EngineView, fs: Any, vdir: str, index: dict, url: str) -> None:
    """The state of the optimizers that step themselves, when this run has them: from the checkpoint, whose
    tensors are checksummed and whose other values are JSON (nothing is unpickled)."""
    generic = getattr(engine, "generic", None)
    if generic is None:
        return
    saved = index.get("torch_optimizers")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{url} holds no torch optimizer state ({'native AdamW moments' if index['optimizer'] else 'weights only'}); "
            "resume with the optimizer it was saved with"
        )
    file = f"{vdir}/{TORCH_OPTIMIZERS}"
    with _explained(fs, vdir, file):
        tensors = stream.read_tensors(fs, file, saved)
    generic.load_saved(saved.get("state"), tensors, url)


def _check_restorable(engine: EngineView, index: dict, url: str, fs: Any, vdir: str, optimizer: bool) -> None:
    """The checkpoint's layout is the engine's, and it holds the optimizer state a resume (`optimizer`) needs."""
    _check_layout(engine, index, url, fs, vdir)
    if optimizer and not index["optimizer"]:
        raise CheckpointError(f"{url} holds weights only (save_weights_only=True); it cannot resume training")


def _saved_steps(rec: dict) -> list[int]:
    """The optimizer step of each parameter of a unit's record (layout order; 0 where it holds no Adam state)."""
    return [param_step(rec, p) if rec["adam"] else 0 for p in rec["params"]]


def _version_to_restore(url: str, pinned: dict | None, storage_options: dict[str, Any] | None) -> tuple:
    """(filesystem, version directory, index) of the version a restore reads: the one `pinned` names (the
    trainer state's), else the one the marker names now."""
    if pinned and "data" in pinned:
        return _pinned_version(url, pinned, storage_options)
    return _index(url, storage_options)


@contextmanager
def _explained(fs: Any, vdir: str, file: str) -> Iterator[None]:
    """A read of the version's `file` inside: its failures as the damage line (or as a replaced checkpoint)."""
    try:
        yield
    except FileNotFoundError:
        raise_if_replaced(fs, vdir)
        raise damaged(fs, vdir, f"{shown(fs, file)} is missing") from None
    except stream.ShardError as err:
        raise damaged(fs, vdir, str(err).replace(file, shown(fs, file), 1)) from None


def _read_file(fs: Any, vdir: str, name: str, targets: dict[str, Any], expect: dict) -> None:
    """stream.read_into of the version's file `name`, its failures explained as damage."""
    file = f"{vdir}/{name}"
    with _explained(fs, vdir, file):
        stream.read_into(fs, file, targets, expect)


def read_unit(fs: Any, vdir: str, rec: dict, *, adam: bool = False) -> dict[str, torch.Tensor]:
    """One unit's flat fp32 tensors, fresh: ``master``, plus ``exp_avg``/``exp_avg_sq`` when `adam` and
    the unit holds them; the whole shard is checksummed (tensors not asked for are read and dropped)."""
    names = ["master", "exp_avg", "exp_avg_sq"] if adam and rec["adam"] else ["master"]
    file = f"{vdir}/{rec['file']}"
    with _explained(fs, vdir, file):  # (allocated once the shard's header vouches for the index's numel)
        return stream.read_new(fs, file, {name: [rec["numel"]] for name in names}, rec)


def read_buffers(fs: Any, vdir: str, index: dict) -> dict[str, torch.Tensor]:
    """The model's buffers as saved (checksummed)."""
    file = f"{vdir}/buffers.safetensors"
    with _explained(fs, vdir, file):
        return stream.read_tensors(fs, file, index["buffers"])


def _restore_buffers(engine: EngineView, fs: Any, vdir: str, index: dict) -> None:
    """The model's buffers from the buffers file, which is checksummed even when the model has none."""
    loaded = {k: torch.empty_like(v) for k, v in _buffers(engine).items()}
    _read_file(fs, vdir, "buffers.safetensors", loaded, index["buffers"])
    if loaded:
        engine.model.load_state_dict(loaded, strict=False)


def _check_layout(engine: EngineView, index: dict, url: str, fs: Any, vdir: str) -> None:
    units = engine.all_units()
    if len(units) != len(index["units"]):
        raise damaged(
            fs,
            vdir,
            f"{url} has {len(index['units'])} parameter units, this model has {len(units)}: it was saved from a "
            "model of another shape; resume with the same model configuration",
        )
    for unit, rec in zip(units, index["units"]):
        saved = [(p["name"], list(p["shape"]), p["offset"]) for p in rec["params"]]
        ours = [(n, list(e.shape), e.offset) for n, e in zip(engine.qualified_names(unit), unit.layout)]
        for theirs, mine in itertools.zip_longest(saved, ours, fillvalue=("nothing", [], 0)):
            if theirs != mine:
                raise damaged(
                    fs,
                    vdir,
                    f"{url}: parameter {theirs[0]} {theirs[1]} does not match this model's {mine[0]} {mine[1]}: it "
                    "was saved from a model of another shape or with other parameter names; resume with the same "
                    "configuration",
                )


def _pointer(fs: Any, path: str, url: str) -> dict:
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        if fs.isdir(f"{path}.d"):
            why = f"{url}: its commit marker is missing ({url}.d holds the data of a save that never committed)"
        else:
            why = f"no checkpoint at {url}: its commit marker is missing (never saved, or the save was interrupted)"
        raise damaged(fs, None, why, path) from None
    if not raw:
        raise damaged(fs, None, f"{url}: its commit marker is empty (the file was truncated)", path)
    try:
        marker = parse_marker(raw)
    except (ValueError, struct.error) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise damaged(fs, None, f"{url}: its commit marker is damaged ({err})", path) from None
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise damaged(
            fs,
            None,
            f"{url}: unsupported checkpoint format {marker.get('format')} v{marker.get('version')} (this version "
            f"reads {FORMAT} v{VERSION})",
            path,
        )
    if not isinstance(marker.get("data"), str) or not isinstance(marker.get("index_crc32"), int):
        raise damaged(fs, None, f"{url}: its commit marker lacks the version or the index checksum", path)
    if not VERSION_NAME.fullmatch(marker["data"]):  # (a name such as "../x" would read outside {url}.d)
        raise damaged(
            fs, None, f"{url}: its commit marker names {marker['data'][:80]!r}, not a version directory", path
        )
    return marker


def param_step(unit_record: dict, param_record: dict) -> int:
    """A parameter's Adam step count; indexes written before steps were kept per parameter have one per unit."""
    return param_record.get("step", unit_record.get("step", 0))
