"""safetensors files streamed straight from and into host buffers, over any fsspec filesystem.

``safetensors.torch.save`` builds the whole file in memory first; at 100B parameters a block is
gigabytes, so this module writes the format itself: an 8-byte little-endian header length, the JSON
header (padded with spaces to 8 bytes), then each tensor's bytes written from a memoryview of the
tensor — no copy. Reading goes the other way with ``readinto`` the destination tensor's memory. A
CRC32 of every byte is kept on the way, so a damaged shard is caught by its checksum.

A tensor that is never whole in host memory (Adam moments on the NVMe tier) is a :class:`Chunked`: its
parts are written, or read into, one after another as its iterator hands them out.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from fsspec.implementations.local import LocalFileSystem
from torch import nn

from megatrain_lightning.checkpoint.verify import load_json


class EngineView(Protocol):
    """What a checkpoint reads and writes of the engine (engine.py's ``Engine``, whose save/load come here)."""

    model: nn.Module
    tier: Any  # the NVMe tier of the Adam moments, or None
    param_order: list[int]
    ranks: Any  # engine/ranks.py's Ranks: one, or this rank's part of W

    def all_units(self) -> list[Any]: ...

    def qualified_names(self, unit: Any) -> list[str]: ...

    def flush(self) -> None: ...

    def refresh_from_masters(self) -> None: ...


# The dtype codes of a safetensors header, by torch dtype (and back).
SAFETENSORS_CODES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
}
_DTYPE_OF_CODE = {v: k for k, v in SAFETENSORS_CODES.items()}


class Chunked:
    """A flat tensor of `numel` elements given as consecutive parts: `parts()` yields CPU tensors that
    together hold its elements in order (to write from, or to read into; each part is done with when the
    iterator is asked for the next one)."""

    def __init__(self, numel: int, dtype: torch.dtype, parts: Callable[[], Iterator[torch.Tensor]]) -> None:
        self.dtype, self.shape, self.parts, self._numel = dtype, torch.Size([numel]), parts, numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def is_contiguous(self) -> bool:
        return True


def _parts(t: torch.Tensor | Chunked) -> Iterator[torch.Tensor]:
    return t.parts() if isinstance(t, Chunked) else iter((t,))


class ShardError(ValueError):
    """A shard's bytes are not what the index promised (checksum, names, shapes or dtypes)."""


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy); works for bf16, which numpy has no type for."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors:
        if t.dtype not in SAFETENSORS_CODES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}; shards hold {sorted(map(str, SAFETENSORS_CODES))}")
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write(fs: Any, path: str, tensors: list[tuple[str, Any]], metadata: dict[str, str] | None = None) -> dict:
    """Write `tensors` (CPU tensors or :class:`Chunked`) as one safetensors file; returns {"bytes": n,
    "crc32": c}."""
    head = _header(tensors, metadata)
    crc, size = zlib.crc32(head), len(head)
    with fs.open(path, "wb") as f:
        f.write(head)
        for name, t in tensors:
            written = 0
            for part in _parts(t):
                view = _bytes(part)
                f.write(view)
                crc, written = zlib.crc32(view, crc), written + view.nbytes
            if written != t.numel() * t.element_size():
                raise ValueError(
                    f"tensor {name!r}: its parts hold {written} bytes, its header says {t.numel() * t.element_size()}"
                )
            size += written
        if isinstance(fs, LocalFileSystem):  # on disk before the commit marker names it (object stores: the PUT)
            f.flush()
            os.fsync(f.fileno())
    return {"bytes": size, "crc32": crc}


def read_header(f: Any, path: str = "shard", size: int | None = None) -> tuple[dict, bytes]:
    """The header of the safetensors file open in `f` and its bytes; ShardError naming `path` when it is
    truncated or not a safetensors header, or (given the file's recorded `size`) describes other sizes."""
    raw_len = f.read(8)
    if len(raw_len) != 8:
        raise ShardError(f"{path} is shorter than a safetensors header: the file is truncated")
    (n,) = struct.unpack("<Q", raw_len)
    if n > (MAX_HEADER if size is None else min(MAX_HEADER, size - 8)):
        raise ShardError(f"{path}: its first 8 bytes claim a {n}-byte header: the header is damaged")
    raw = f.read(n)
    if len(raw) != n:
        raise ShardError(f"{path} ends inside its {n}-byte header: the file is truncated")
    try:
        header = load_json(raw)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike, and nesting past any header's
        raise ShardError(f"{path}: its header is not safetensors JSON: the header is damaged") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    if entries is None or not all(_valid_entry(v) for v in entries.values()):
        raise ShardError(f"{path}: its header does not describe safetensors tensors: the header is damaged")
    bad = next((k for k, v in entries.items() if not _sized(v)), None)
    if bad is not None:
        meta = entries[bad]
        raise ShardError(
            f"{path}: tensor {bad!r} is {meta['dtype']}{meta['shape']} in {_span(meta)} bytes: the header is damaged"
        )
    if not _tiled(entries.values()):
        raise ShardError(f"{path}: its tensors' byte ranges overlap or leave gaps: the header is damaged")
    data = sum(_span(v) for v in entries.values())
    if size is not None and 8 + n + data != size:
        raise ShardError(
            f"{path}: its header describes {8 + n + data} bytes, the index recorded {size}: the header is damaged"
        )
    actual = _size_of(f)
    if 8 + n + data > actual:  # before anything is allocated by these sizes
        raise ShardError(
            f"{path} ends early: its header describes {8 + n + data} bytes, the file has {actual}: the file is "
            "truncated or its header damaged"
        )
    return header, raw_len + raw


MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


def _sized(meta: dict) -> bool:
    """Whether a tensor's byte range holds exactly its shape in its dtype (unknown dtypes: read as bytes)."""
    dtype = _DTYPE_OF_CODE.get(meta["dtype"])
    if dtype is None:
        return True
    n = 1
    for d in meta["shape"]:
        n *= d
    return n * torch.tensor([], dtype=dtype).element_size() == _span(meta)


def _tiled(metas: Any) -> bool:
    """Whether the tensors' byte ranges follow one another from 0, as every writer of the format lays them."""
    end = 0
    for start, stop in sorted(m["data_offsets"] for m in metas):
        if start != end:
            return False
        end = stop
    return True


def _size_of(f: Any) -> int:
    """The size of the open file `f`, its position kept (fsspec's files know it without a read)."""
    here = f.tell()
    size = f.seek(0, os.SEEK_END)
    f.seek(here)
    return size


def _valid_entry(meta: Any) -> bool:
    try:
        start, end = meta["data_offsets"]
        shape_ok = all(isinstance(d, int) and d >= 0 for d in meta["shape"])
        return isinstance(meta["dtype"], str) and shape_ok and isinstance(start, int) and 0 <= start <= end
    except (TypeError, KeyError, ValueError):
        return False


def read_into(fs: Any, path: str, targets: dict[str, Any], expect: dict) -> None:
    """Fill `targets` (contiguous CPU tensors, or :class:`Chunked`) from the file's tensors of the same
    names, checking that names, dtypes and shapes match and that the file's CRC32 equals ``expect["crc32"]``."""
    with fs.open(path, "rb") as f:
        header, head_bytes = read_header(f, path, expect.get("bytes"))
        crc = zlib.crc32(head_bytes)
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
        )
        for name, meta in entries:
            dst = targets.get(name)
            _check_entry(path, name, meta, dst)
            for part in _parts(dst) if dst is not None else _skipped(_span(meta)):
                view = _bytes(part)
                _readinto_fully(f, view, path)
                crc = zlib.crc32(view, crc)
    missing = sorted(set(targets) - {k for k, _ in entries})
    if missing:
        raise ShardError(f"{path} lacks tensors {missing}: it is not the shard the index names")
    if crc != expect["crc32"]:
        raise ShardError(
            f"{path} has checksum {crc:#010x}, the index recorded {expect['crc32']:#010x}: the file is damaged"
        )


def read_new(fs: Any, path: str, shapes: dict[str, list[int]], expect: dict) -> dict[str, torch.Tensor]:
    """The file's fp32 tensors of these names and `shapes`, in fresh CPU tensors allocated only once its header
    (checked against the file's real size) says it holds them so, then read as :func:`read_into` does."""
    with fs.open(path, "rb") as f:
        header, _ = read_header(f, path, expect.get("bytes"))
    missing = sorted(set(shapes) - set(header))
    if missing:
        raise ShardError(f"{path} lacks tensors {missing}: it is not the shard the index names")
    for name, shape in shapes.items():  # (meta tensors: the shapes compared, nothing allocated)
        _check_entry(path, name, header[name], torch.empty(shape, dtype=torch.float32, device="meta"))
    targets = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    read_into(fs, path, targets, expect)
    return targets


def read_tensors(fs: Any, path: str, expect: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the file, in fresh CPU tensors of the dtypes and shapes its header names, checked
    against ``expect["crc32"]`` as :func:`read_into` does."""
    with fs.open(path, "rb") as f:
        header, _ = read_header(f, path, expect.get("bytes"))
    targets = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPE_OF_CODE:
            raise ShardError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; shards hold {sorted(_DTYPE_OF_CODE)}")
        targets[name] = torch.empty(meta["shape"], dtype=_DTYPE_OF_CODE[meta["dtype"]])
    read_into(fs, path, targets, expect)
    return targets


def _skipped(nbytes: int, chunk: int = 16 * 2**20) -> Iterator[torch.Tensor]:
    """Scratch to read (and checksum) `nbytes` not asked for, a bounded chunk at a time."""
    scratch = torch.empty(min(nbytes, chunk), dtype=torch.uint8)
    for lo in range(0, nbytes, chunk):
        yield scratch[: min(chunk, nbytes - lo)]


def _span(meta: dict) -> int:
    start, end = meta["data_offsets"]
    return end - start


def _check_entry(path: str, name: str, meta: dict, dst: torch.Tensor | Chunked | None) -> None:
    if dst is None:
        return
    if not dst.is_contiguous():
        raise ValueError(f"cannot read {name!r} into a non-contiguous tensor")
    if _DTYPE_OF_CODE.get(meta["dtype"]) != dst.dtype or list(meta["shape"]) != list(dst.shape):
        raise ShardError(
            f"{path}: tensor {name!r} is {meta['dtype']}{meta['shape']}, this model needs {SAFETENSORS_CODES[dst.dtype]}{list(dst.shape)}"
        )


def _readinto_fully(f: Any, view: memoryview, path: str) -> None:
    done = 0
    while done < view.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ShardError(f"{path} ends early: the file is truncated")
        done += n
