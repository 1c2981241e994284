"""The data versions of a checkpoint: leases of the saves writing them, what may be deleted, durable writes.

Every save writes a fresh version directory ``<url>.d/<version>/`` (store.py), so writers never touch one
another's files; what they can hurt is what they delete. A version is deleted only when it is provably
of no use:

- **live**, never deleted: a save is writing it. Its writer keeps a lease, ``<version>/lease.json``, with
  a heartbeat time it rewrites after every unit (and after each other file). The lease is an ordinary
  file or object, not a lock (object stores have none): it is read, not held. A lease whose writer ran
  on this machine (same host, boot and process namespace) and whose process is gone proves the save
  dead at once; otherwise the lease lapses when its heartbeat is older than :data:`LEASE_TIMEOUT_S`
  (machines writing one checkpoint need clocks agreeing to well within that, which NTP gives). A
  directory not yet holding its lease is young by its name (``v<start time in ns, hex>-<random>``) and
  counts as live while that start time is.
- **abandoned**: its save died or gave up before the commit (lease lapsed, or no lease and an old name).
  Deleted, with a warning naming it, by the next save to that name. A save that fails with an exception
  deletes its own version before raising.
- **committed**: its lease says ``committed`` (rewritten right after the marker named it). It stays
  while the marker names it or names it as the version it replaced (``previous``); older ones are
  deleted.

Nothing else in ``<url>.d`` is touched. Only entries this format names (``v<hex>-<hex>``) that are real
directories (never a symbolic link, checked with lstat) count as versions; a directory without a lease is
deleted only when it holds nothing but the names a save writes. A save refuses a ``<url>.d`` that is a
symbolic link, a file, or holds anything else (:func:`foreign`): deleting through a link, or beside a
stranger's files, could reach data that no save wrote.

So the checkpoint that was current when a newer save committed stays whole until the save after that
starts, in case a reader had read the old marker just before the commit. Storage: two versions between
saves, and during a save the current one and the one being written (the kept one goes at the start).
Readers (store.py) still handle the rare read that outlives even that: when the version they are
reading vanishes, they re-read the marker and, when it moved on, read the new checkpoint.

A writer whose heartbeat lapsed (a unit took longer than the timeout to write) notices at its next
beat that its lease is gone, and fails rather than commit a version others may have deleted.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

LEASE_TIMEOUT_S = 15 * 60.0
"""A lease not renewed for this long marks its version abandoned. It must exceed the time one unit's
shard takes to write; tests lower it."""

LEASE = "lease.json"


VERSION_NAME = re.compile(r"v([0-9a-f]+)-[0-9a-f]+")
"""The names of version directories (:func:`new_version`): the only entries of ``<url>.d`` a save touches."""

WRITTEN = ("units", "index.json", "buffers.safetensors", "trainer.pt", LEASE)
"""What a save writes in its version directory (and ``lease.json.tmp-*`` while renewing the lease)."""


def new_version() -> str:
    """A version name that sorts by start time and says when its save started."""
    return f"v{time.time_ns():x}-{uuid.uuid4().hex[:8]}"


def _started_s(name: str) -> float:
    found = VERSION_NAME.fullmatch(name)
    return int(found.group(1), 16) / 1e9 if found else 0.0


def foreign(fs: Any, path: str) -> str | None:
    """Why ``<path>.d`` is no data directory that only this format's saves wrote ("is a symbolic link ...",
    "holds 'x' ..."), or None (also when it does not exist yet)."""
    root = f"{path}.d"
    if isinstance(fs, LocalFileSystem):
        try:
            mode = os.lstat(root).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            return f"is a symbolic link (to {os.readlink(root)})"
        if not stat.S_ISDIR(mode):
            return "is a file, not a checkpoint's data directory"
    fs.invalidate_cache(root)  # (object store listings are cached per filesystem object)
    if not isinstance(fs, LocalFileSystem):
        # One question, not isdir() then exists(): another writer may add or remove the last version between
        # two, and "not a directory, yet it exists" would then call an ordinary data directory a file.
        try:
            kind = fs.info(root).get("type")
        except FileNotFoundError:
            return None
        if kind != "directory":
            return "is a file, not a checkpoint's data directory"
    for name, _, ours in _entries(fs, root):
        if not ours:
            return f"holds {name!r}, which no save of this format wrote"
    return None


def _entries(fs: Any, root: str) -> list[tuple[str, str, bool]]:
    """(name, path, whether it is a version directory) of each entry of `root`; links are never followed."""
    if isinstance(fs, LocalFileSystem):
        try:
            with os.scandir(root) as listing:
                found = [(e.name, f"{root}/{e.name}", e.is_dir(follow_symlinks=False)) for e in listing]
        except (FileNotFoundError, NotADirectoryError):
            return []
    else:
        found = []
        for info in fs.ls(root, detail=True):
            entry = info["name"].rstrip("/")
            found.append((entry.rsplit("/", 1)[-1], entry, info.get("type") == "directory"))
    return [(name, entry, is_dir and VERSION_NAME.fullmatch(name) is not None) for name, entry, is_dir in found]


def _is_link(fs: Any, root: str) -> bool:
    return isinstance(fs, LocalFileSystem) and os.path.islink(root)


def _machine() -> str:
    """Where a pid means a process: the host, its boot and the pid namespace (containers share hostnames)."""
    parts = [socket.gethostname()]
    for probe in (
        lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        lambda: os.readlink("/proc/self/ns/pid"),
    ):
        try:
            parts.append(probe())
        except OSError:
            parts.append("?")
    return " ".join(parts)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    try:  # a killed process not yet reaped by its parent is a zombie: dead all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class Lease:
    """The lease of one save on its version directory; taking it creates the directory."""

    def __init__(self, fs: Any, path: str, url: str) -> None:
        self.fs, self.url, self.version = fs, url, new_version()
        self.vdir = f"{path}.d/{self.version}"
        self._me = {"token": uuid.uuid4().hex, "machine": _machine(), "pid": os.getpid()}
        # The lease first: a writer dying before it leaves an empty directory (which counts as live while
        # young, and is removed after LEASE_TIMEOUT_S), never data without a lease.
        fs.makedirs(self.vdir, exist_ok=True)
        self._write("writing")
        fs.makedirs(f"{self.vdir}/units", exist_ok=True)
        sync_dirs(fs, [os.path.dirname(path) or ".", f"{path}.d", self.vdir])  # the new entries themselves

    def beat(self) -> None:
        """Renew the heartbeat, after checking that the lease is still this save's."""
        try:
            held = json.loads(self.fs.cat_file(f"{self.vdir}/{LEASE}"))
        except FileNotFoundError:
            held = None
        if not isinstance(held, dict) or held.get("token") != self._me["token"]:
            raise RuntimeError(
                f"saving {self.url}: another writer removed this save's data {self.vdir} as abandoned: its "
                f"lease was not renewed for {LEASE_TIMEOUT_S:g} s; raise "
                "megatrain_lightning.checkpoint.versions.LEASE_TIMEOUT_S above the time one unit takes to write"
            )
        self._write("writing")

    def committed(self) -> None:
        self._write("committed")

    def release(self) -> None:
        """The save failed: delete its version (what another writer has not deleted already)."""
        _rm(self.fs, self.vdir)

    def _write(self, state: str) -> None:
        data = json.dumps({**self._me, "state": state, "heartbeat": time.time()}).encode()
        if isinstance(self.fs, LocalFileSystem):  # a reader sees the old lease or the new one, never half
            tmp = f"{self.vdir}/{LEASE}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, f"{self.vdir}/{LEASE}")
        else:
            self.fs.pipe_file(f"{self.vdir}/{LEASE}", data)  # one PUT: atomic


def state_of(fs: Any, entry: str, now: float) -> str:
    """``live``, ``abandoned``, ``committed``, ``empty`` (a listing entry with no files: object stores may
    list an emptied prefix) or ``foreign`` (no lease, and holding what no save writes: never deleted)."""
    try:
        lease = json.loads(fs.cat_file(f"{entry}/{LEASE}"))
    except (FileNotFoundError, ValueError, RecursionError):  # no lease yet (or from before leases), or torn
        lease = None
    if not isinstance(lease, dict):
        lease = None
    if lease is None:
        if now - _started_s(entry.rstrip("/").rsplit("/", 1)[-1]) < LEASE_TIMEOUT_S:
            return "live"  # its writer is between creating the directory and writing the lease
        inside = [name for name, _, _ in _entries(fs, entry.rstrip("/")) if name != LEASE]
        if any(name not in WRITTEN and not name.startswith(f"{LEASE}.tmp-") for name in inside):
            return "foreign"  # not what a save writes: kept, whatever its name says
        has_files = [f for f in fs.find(entry) if f.rstrip("/") != entry.rstrip("/")]
        return "abandoned" if has_files else "empty"
    if lease.get("state") == "committed":
        return "committed"
    pid, heartbeat = lease.get("pid", -1), lease.get("heartbeat", 0)
    if not (isinstance(pid, int) and isinstance(heartbeat, (int, float))):
        return "abandoned"  # no writer of this format wrote that lease: it renews nothing
    dead_here = lease.get("machine") == _machine() and pid > 0 and _process_gone(pid)
    if dead_here or now - heartbeat > LEASE_TIMEOUT_S:
        return "abandoned"
    return "live"


def remove_unused(fs: Any, path: str, keep: Callable[[], set[str]], warn: bool = True) -> None:
    """Delete the versions of ``<path>`` that are not live and not in `keep()`, which is called after every
    lease was read (so that a version whose lease said ``committed`` was named by the marker before that
    read: `keep` sees it, or sees the marker past it). Only version directories are looked at, and a
    symbolic link ``<path>.d`` is not followed (see :func:`foreign`)."""
    root = f"{path}.d"
    fs.invalidate_cache(root)  # listings are cached per filesystem object; other processes write here
    if _is_link(fs, root) or not fs.isdir(root):
        return
    now = time.time()
    states = {}
    for name, entry, ours in _entries(fs, root):
        if ours:
            states[name] = (entry, state_of(fs, entry, now))
    kept = keep()
    for name, (entry, state) in states.items():
        if state in ("live", "foreign") or name in kept:
            continue
        if state == "abandoned" and warn:
            warnings.warn(f"removing {root}/{name}: data of an interrupted save, never committed", stacklevel=4)
        _rm(fs, entry)


def _rm(fs: Any, entry: str) -> None:
    try:
        fs.rm(entry, recursive=True)
    except FileNotFoundError:  # another writer deleted it first; on object stores an emptied prefix vanishes
        pass


def drop_if_empty(fs: Any, root: str) -> None:
    """Delete the directory `root` if nothing is in it (a writer may have just created a version there)."""
    try:
        fs.rmdir(root)
    except OSError:  # not empty, or gone (FileNotFoundError), or an object store's prefix
        pass


# -- durable writes ------------------------------------------------------------------------------------
# On a local filesystem a file's bytes and its directory entry reach the disk only when fsynced: a power
# loss after the marker's os.replace could otherwise leave a marker naming shards that were never written.
# Object stores need none of this: an object is durable and visible to every reader once its PUT returns.


def write_bytes(fs: Any, path: str, data: bytes) -> None:
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sync_dirs(fs: Any, dirs: list[str]) -> None:
    """fsync directories, so that the entries created in them survive a power loss (local filesystems)."""
    if not isinstance(fs, LocalFileSystem) or os.name == "nt":  # (Windows cannot open a directory to sync it)
        return
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
