"""What a reader checks before it trusts a sharded checkpoint, and how it says what is wrong.

The commit marker is JSON framed as a tiny pickle (:func:`marker_bytes`) so that ``torch.load`` stops on
it with :data:`REFUSAL`; :func:`parse_marker` takes the frame apart by hand and never unpickles it. A
reader then checks ``index.json`` against the marker's CRC32 and its keys (:func:`index_lacks`), and every
shard, the buffers file and ``trainer.pt`` against the index (``stream`` and ``store``). Whatever fails is
one :class:`CheckpointError` line made by :func:`damaged`: the file, what is wrong with it, and the intact
checkpoints saved earlier in the same directory (their markers parse and their indexes match their
checksums; their shards are not read, so this stays cheap), or "none".
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from fsspec.implementations.local import LocalFileSystem

FORMAT = "megatrain-checkpoint"
VERSION = 1


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


def marker_bytes(marker: dict) -> bytes:
    """The commit marker's bytes: `marker` as JSON inside a pickle that torch.load refuses with REFUSAL."""
    body = json.dumps(marker).encode()
    # GLOBAL names "module" REFUSAL, attribute "ckpt": torch's weights-only refusal shows "REFUSAL.ckpt".
    return _PICKLE_HEAD + REFUSAL.encode() + b"\nckpt\nX" + struct.pack("<I", len(body)) + body + b"\x85R."


def parse_marker(raw: bytes) -> dict:
    """The JSON of a commit marker (framed as :func:`marker_bytes` writes it, or bare); ValueError naming
    what is wrong if it is neither (never unpickled: the frame is taken apart by hand)."""
    if raw.lstrip().startswith(b"{"):
        marker = json.loads(raw)
    elif not raw.startswith(_PICKLE_HEAD + _TAG.encode()):
        raise ValueError("not a commit marker of this format")
    else:
        name_end = raw.find(b"\n", raw.find(b"\n", len(_PICKLE_HEAD)) + 1)
        if name_end < 0 or raw[name_end + 1 : name_end + 2] != b"X" or len(raw) < name_end + 6:
            raise ValueError("it ends inside its frame: truncated")
        (n,) = struct.unpack("<I", raw[name_end + 2 : name_end + 6])
        body = raw[name_end + 6 : name_end + 6 + n]
        if len(body) != n or raw[name_end + 6 + n :] != b"\x85R.":
            raise ValueError(f"its frame holds {len(body)} of {n} bytes of JSON: truncated or altered")
        marker = json.loads(body)
    if not isinstance(marker, dict):
        raise ValueError("its JSON is not an object")
    return marker


def looks_like_marker(head: bytes) -> bool:
    """Whether a file's first bytes are a commit marker of this format, whole or truncated (a Lightning
    .ckpt file starts otherwise: a zip archive, or a pickle of other opcodes)."""
    frame = _PICKLE_HEAD + _TAG.encode()
    if len(head) >= len(_PICKLE_HEAD) and head[: len(frame)] == frame[: len(head)]:
        return True
    return head.lstrip().startswith(b"{") and FORMAT.encode() in head  # a bare JSON marker, as first written


def index_lacks(index: Any) -> str | None:
    """What a parsed index.json lacks of what the readers use ("key 'units'", ...), or None."""
    if not isinstance(index, dict):
        return "an object at its top"
    for key, kind in (("units", list), ("buffers", dict), ("optimizer", bool)):
        if not isinstance(index.get(key), kind):
            return f"key {key!r}"
    if not isinstance(index["buffers"].get("crc32"), int):
        return "key 'buffers.crc32'"
    for i, rec in enumerate(index["units"]):
        for key in ("file", "numel", "adam", "params", "crc32", "bytes"):
            if not isinstance(rec, dict) or key not in rec:
                return f"key 'units[{i}].{key}'"
        if not all(isinstance(p, dict) and {"name", "offset", "shape"} <= set(p) for p in rec["params"]):
            return f"the name, offset or shape of a parameter of units[{i}]"
    return None


def damaged(fs: Any, vdir: str | None, why: str, path: str | None = None) -> CheckpointError:
    """One line: `why`, then the intact checkpoints saved before this one (version directory `vdir`; None:
    unknown, the newest data in ``<path>.d`` dates it) in the same directory, or "none"."""
    path = path if vdir is None else vdir.rsplit(".d/", 1)[0]
    if vdir is not None:
        before = _saved_at(vdir.rsplit("/", 1)[-1])
    else:
        versions = [_saved_at(v.rstrip("/").rsplit("/", 1)[-1]) for v in ls(fs, f"{path}.d")]
        before = max(versions) if versions else None
    intact = intact_before(fs, path, before)
    folder = shown(fs, path.rsplit("/", 1)[0] if "/" in path else ".")
    return CheckpointError(f"{why}; intact earlier checkpoints in {folder}: {', '.join(intact) or 'none'}")


def intact_before(fs: Any, path: str, before: int | None) -> list[str]:
    """Names of the checkpoints beside `path` whose marker parses and whose index matches its checksum
    (their shards are not read), saved before `before` (ns; None: any), newest first."""
    found = []
    for entry in ls(fs, path.rsplit("/", 1)[0] if "/" in path else ".", detail=True):
        name = entry["name"].rstrip("/")
        if entry.get("type") != "file" or name == path or (entry.get("size") or 0) > 65536:
            continue
        try:
            marker = parse_marker(fs.cat_file(name))
            version = marker["data"]
            intact = marker["format"] == FORMAT and zlib.crc32(fs.cat_file(f"{name}.d/{version}/index.json"))
            intact = intact == marker["index_crc32"]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            continue
        if intact and (before is None or _saved_at(version) < before):
            found.append((_saved_at(version), name.rsplit("/", 1)[-1]))
    return [name for _, name in sorted(found, reverse=True)]


def ls(fs: Any, folder: str, detail: bool = False) -> list[Any]:
    try:
        return fs.ls(folder, detail=detail)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _saved_at(version: str) -> int:
    """When a version directory was written (its name starts ``v<time_ns in hex>-``); 0 if not such a name."""
    try:
        return int(version[1:].split("-", 1)[0], 16) if version.startswith("v") else 0
    except ValueError:
        return 0


def shown(fs: Any, path: str) -> str:
    """`path` as the user wrote it: with its protocol, except for local files."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
