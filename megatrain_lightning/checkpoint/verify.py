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
import re
import struct
import zlib
from typing import Any

from fsspec.implementations.local import LocalFileSystem

FORMAT = "megatrain-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged or of another model; the message names path and fix."""


MAX_JSON_DEPTH = 64
"""How deeply the JSON of a marker, index or shard header may nest (the format's own nests 5 levels; a Hugging
Face config within the index a few more). Deeper is refused before anything recurses through it."""


def load_json(raw: bytes | str) -> Any:
    """``json.loads(raw)``; ValueError for nesting deeper than :data:`MAX_JSON_DEPTH` (json itself recurses:
    a file nested 100,000 deep would raise RecursionError there, or in whatever walks the result later)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"its JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:  # (iterative: the check itself must not recurse)
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"its JSON nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


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
        marker = load_json(raw)
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
        marker = load_json(body)
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
        if not isinstance(rec["params"], list) or not all(
            isinstance(p, dict) and {"name", "offset", "shape"} <= set(p) for p in rec["params"]
        ):
            return f"the name, offset or shape of a parameter of units[{i}]"
    return None


VERSION_NAME = re.compile(r"v[0-9a-f]+-[0-9a-f]+")
"""A version directory's name (versions.new_version): a marker or index naming anything else is refused."""
UNIT_FILE = re.compile(r"units/[0-9]+\.safetensors")
"""A unit shard's name inside its version directory: an index naming anything else is refused."""
MAX_STEP = 2**53  # (exact as a float, as torch.optim keeps it)


def index_invalid(index: dict) -> str | None:
    """What in an index (that :func:`index_lacks` passed) cannot be what a save wrote, or None: names
    leaving the version directory, sizes, steps and offsets out of range, parameters that do not tile
    their unit exactly (each offset where the one before ends, the last ending at the unit's numel, so no
    parameter's values can be read as another's). Every number a reader allocates or indexes by is here."""
    if "data" in index and not _is_name(index["data"], VERSION_NAME):
        return f"'data' is {_short(index['data'])}, not a version directory's name"
    if not _count(index["buffers"].get("bytes", 0)):
        return f"'buffers.bytes' is {_short(index['buffers'].get('bytes'))}, not a size"
    for i, rec in enumerate(index["units"]):
        where = f"units[{i}]"
        if not _is_name(rec["file"], UNIT_FILE):
            return f"{where}.file is {_short(rec['file'])}, not a unit shard of this version directory"
        for key in ("numel", "bytes", "crc32"):
            if not _count(rec[key]):
                return f"{where}.{key} is {_short(rec[key])}, not a non-negative integer"
        if not isinstance(rec["adam"], bool):
            return f"{where}.adam is {_short(rec['adam'])}, not true or false"
        if "step" in rec and not _count(rec["step"], MAX_STEP):
            return f"{where}.step is {_short(rec['step'])}, not a step count"
        problem = _params_invalid(rec, where)
        if problem is not None:
            return problem
    aliases = index.get("aliases") or {}
    names = {p["name"] for rec in index["units"] for p in rec["params"]}
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and v in names for k, v in aliases.items()):
        return "'aliases' do not map names to parameters of the index"
    groups = index.get("param_groups")
    if groups is not None and not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)):
        return "'param_groups' is not a list of settings"
    order = index.get("param_order")
    if order is not None and not (isinstance(order, list) and all(isinstance(n, str) for n in order)):
        return "'param_order' is not a list of parameter names"
    return None


def _params_invalid(rec: dict, where: str) -> str | None:
    end = 0
    for p in sorted(rec["params"], key=lambda p: p["offset"] if _count(p["offset"]) else -1):
        name, shape = p["name"], p["shape"]
        if not isinstance(name, str):
            return f"{where} has a parameter named {_short(name)}"
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            return f"{where}: parameter {name} has shape {_short(shape)}"
        if "step" in p and not _count(p["step"], MAX_STEP):
            return f"{where}: parameter {name} has step {_short(p['step'])}, not a step count"
        if p.get("group") is not None and not _count(p["group"]):
            return f"{where}: parameter {name} has group {_short(p['group'])}"
        if not _count(p["offset"]) or p["offset"] != end:
            return (
                f"{where}: parameter {name} starts at offset {_short(p['offset'])}, where the parameters before it "
                f"end at {end}: parameters must tile their unit without gaps or overlap"
            )
        end += _numel(shape)
        if end > rec["numel"]:
            return f"{where}: parameter {name} ends at {end}, past the unit's {rec['numel']} values"
    if end != rec["numel"]:
        return f"{where}: its parameters hold {end} values, the unit {rec['numel']}"
    return None


def _count(value: Any, limit: int = 2**62) -> bool:
    """Whether `value` is a JSON integer in [0, limit) (true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_name(value: Any, pattern: re.Pattern) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


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
