"""Read and write Hugging Face checkpoints (config.json + safetensors) without ``transformers``.

Memory is the point of this package, so both directions stream: loading copies one tensor at a
time from a memory-mapped shard into its parameter, and saving holds at most one shard's tensors.
Every file is written under a temporary name and renamed into place, so a crash mid-save never
leaves a truncated file under a name a loader would trust.
"""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import LlamaConfig
from .llama import LlamaForCausalLM

SOURCE_ATTR = "_megatrain_source"
"""Attribute of a meta parameter: a callable returning the tensor (any dtype, the parameter's shape) to fill
it from. Set by the loader here, read and removed by the engine when it fills its masters
(engine/host/materialize.py); models never import the engine."""

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_TIED_KEY = "lm_head.weight"
# Written by old transformers versions; derived from the config here, so safe to ignore.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------- loading


def load_hf_config(directory: str | os.PathLike) -> LlamaConfig:
    """The ``LlamaConfig`` described by ``directory/config.json``."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {directory}")
    with open(path, encoding="utf-8") as f:
        return LlamaConfig.from_hf_dict(json.load(f))


def _weight_files(directory: Path) -> dict[str, list[str]]:
    """Shard file name -> the tensor names it holds (from the index, or the single file's header)."""
    index = directory / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for key, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                # (a shard is a file of this directory: a path such as ../../x would read outside it)
                raise ValueError(f"{index} maps {key!r} to {file!r}, which is not a file name in {directory}.")
            files.setdefault(file, []).append(key)
        return files
    if (directory / SINGLE_FILE).is_file():
        with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
            return {SINGLE_FILE: list(f.keys())}
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else "directory missing"
    raise FileNotFoundError(f"Neither {INDEX_FILE} nor {SINGLE_FILE} in {directory} (found: {present})")


def _expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # remove_duplicate=False lists a tied weight under both names, as HF state dicts do.
    expected = dict(model.named_parameters(remove_duplicate=False))
    expected.update(model.named_buffers(remove_duplicate=False))
    return expected


def _required(model: nn.Module) -> dict[int, list[str]]:
    """What a checkpoint must hold: per parameter and persistent buffer (by identity), the names it goes by.
    A tied weight (``lm_head.weight`` is ``embed_tokens.weight`` under ``tie_word_embeddings``) is one tensor
    with two names, and a checkpoint holding either fills it."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                names.setdefault(id(b), []).append(f"{prefix}.{name}" if prefix else name)
    return names


def _plan_load(model: nn.Module, directory: Path) -> dict[str, list[str]]:
    """Validate every key and shape against the model before any copy: shard -> keys to load. Of the names
    of one tied tensor, the first the model lists that the checkpoint holds is read (HF, too, ignores a
    stored ``lm_head.weight`` when the embeddings are tied)."""
    expected = _expected_tensors(model)
    required = _required(model)
    files = _weight_files(directory)
    present = {key for keys in files.values() for key in keys}
    chosen = {next((n for n in aliases if n in present), aliases[0]) for aliases in required.values()}
    second = {n for aliases in required.values() for n in aliases} - chosen  # a tied tensor's other names
    plan: dict[str, list[str]] = {}
    for file, keys in files.items():
        with safe_open(str(directory / file), framework="pt") as f:
            in_file = set(f.keys())
            for key in keys:
                if key.endswith(_IGNORED_SUFFIXES) or (key in second):
                    continue  # derived from the config, or the second name of a tied weight
                _check_key(key, expected, in_file, f, file)
                plan.setdefault(file, []).append(key)
    missing = sorted(chosen - present)
    if missing:
        raise ValueError(
            f"Checkpoint {directory} lacks {len(missing)} tensors the model needs: {missing[:8]}; load a checkpoint "
            "of this model's architecture and config (tie_word_embeddings included), into the module whose "
            "state_dict() names match it (e.g. the Hugging Face model inside a LightningModule)"
        )
    return plan


def _check_key(key: str, expected: dict[str, torch.Tensor], present: set[str], f, file: str) -> None:
    if key not in expected:
        raise ValueError(
            f"Unexpected tensor {key!r} in {file}: the model has no such parameter or buffer; load the checkpoint "
            "into the module whose state_dict() names match it, built from the checkpoint's config.json"
        )
    if key not in present:
        raise ValueError(
            f"Tensor {key!r} is listed in the index for {file} but that file lacks it: re-save the checkpoint."
        )
    shape = tuple(f.get_slice(key).get_shape())
    if shape != tuple(expected[key].shape):
        raise ValueError(
            f"Shape mismatch for {key!r} in {file}: checkpoint has {shape}, model expects {tuple(expected[key].shape)}; "
            "build the model from the checkpoint's config.json."
        )


class _Deferred:
    """Reads one checkpoint tensor when called: what a meta parameter is filled from by the engine. The file
    is opened per tensor, so that no more than that tensor of it is mapped in at a time."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key

    def __call__(self) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt", device="cpu") as f:
            return f.get_tensor(self.key)


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load a HF safetensors checkpoint (single file or sharded, any dtype) into ``model``, any module whose
    ``state_dict()`` names match the checkpoint's (this project's Llama, or a ``transformers`` model).

    Keys and shapes are all checked first (a ValueError names the key, the shapes and the file),
    so a bad checkpoint never leaves the model half-loaded. Tensors are then read one at a time
    and copied (with dtype cast) into the existing parameters, so peak extra memory is one tensor.

    A parameter on the meta device (a model built under ``trainer.init_module(empty_init=True)`` or
    ``fabric.init_module(empty_init=True)`` with strategy="megatrain") is not copied into: it is told which
    tensor fills it, and the strategy reads each one into its fp32 master as it sets the model up, so the
    model never exists in fp32 beside those masters (engine/host/materialize.py). Buffers are copied now.
    """
    directory = Path(directory)
    expected = _expected_tensors(model)
    plan = _plan_load(model, directory)
    for name, t in expected.items():
        if t.is_meta and not isinstance(t, nn.Parameter):
            raise ValueError(
                f"buffer {name!r} is on the meta device, where nothing can be loaded into it: build the model under "
                "trainer.init_module(empty_init=True) (or fabric.init_module), which keeps buffers real"
            )
    for file, keys in plan.items():
        with safe_open(str(directory / file), framework="pt", device="cpu") as f:
            for key in keys:
                if expected[key].is_meta:
                    setattr(expected[key], SOURCE_ATTR, _Deferred(directory / file, key))
                    continue
                tensor = f.get_tensor(key)
                expected[key].copy_(tensor)
                del tensor  # drop our only reference before reading the next one


def from_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Build the model described by ``directory/config.json`` and load its weights.

    The model is constructed on the meta device and materialized uninitialized with ``to_empty``,
    so no time or memory goes into a random init that the checkpoint overwrites anyway.
    """
    config = load_hf_config(directory)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty re-creates each module's Parameter, which unties them
    load_hf_weights(model, directory)
    return model


# ---------------------------------------------------------------------------- saving


@contextmanager
def _temporary_path(final: Path) -> Iterator[Path]:
    """A sibling temp path that is renamed to ``final`` on success and deleted on failure."""
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(obj: dict, final: Path) -> None:
    with _temporary_path(final) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _to_cpu(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype)
    # safetensors refuses views that share storage with other tensors; copy only when needed.
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.contiguous().clone()
    return t


def _write_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    directory: Path,
    max_shard_bytes: int,
    dtype: torch.dtype | None,
    skip: set[str],
    shards: list[tuple[Path, list[str]]],
) -> tuple[int, torch.dtype | None]:
    """Stream tensors into temp-named shards, appending (temp path, keys) to ``shards`` as each is
    started (so the caller can clean up after a failure); returns total bytes and the first dtype."""
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0
    seen: set[str] = set()
    saved_dtype = None
    mode = _ordinary_file_mode(directory)

    def flush() -> None:
        nonlocal current, current_bytes
        tmp = directory / f".shard-{len(shards):05d}-{uuid.uuid4().hex[:8]}.tmp"
        shards.append((tmp, list(current)))  # recorded first so a failed write is cleaned up
        save_file(current, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, mode)  # safetensors creates its files 0600, whatever the umask
        current, current_bytes = {}, 0  # release the shard's tensors before building the next

    for name, tensor in named_tensors:
        if name in skip:
            continue
        if name in seen:
            raise ValueError(f"Tensor name {name!r} appears twice in the checkpoint stream.")
        seen.add(name)
        t = _to_cpu(tensor, dtype)
        saved_dtype = saved_dtype or t.dtype
        nbytes = t.numel() * t.element_size()
        if current and current_bytes + nbytes > max_shard_bytes:
            flush()
        current[name], current_bytes, total = t, current_bytes + nbytes, total + nbytes
    if current or not shards:
        flush()
    return total, saved_dtype


def _finalize_shards(shards: list[tuple[Path, list[str]]], directory: Path, total: int) -> set[str]:
    """Rename temp shards to HF's names (single file or indexed shards); returns the final names."""
    if len(shards) == 1:
        os.replace(shards[0][0], directory / SINGLE_FILE)
        return {SINGLE_FILE}
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, (tmp, keys) in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, directory / name)
        weight_map.update((key, name) for key in keys)
    # The index goes last: once it exists, every shard it names is complete.
    _write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, directory / INDEX_FILE)
    return set(weight_map.values()) | {INDEX_FILE}


def _remove_stale(directory: Path, keep: set[str]) -> None:
    """Delete weight files of an earlier save into the same directory that this save superseded."""
    for path in directory.iterdir():
        stale = _SHARD_RE.match(path.name) or path.name == INDEX_FILE
        if stale and path.name not in keep:
            path.unlink()


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: LlamaConfig | dict,
    directory: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
) -> None:
    """Write a HF checkpoint from a lazy stream of (HF name, tensor) pairs.

    The shard count is only known at the end of a single pass over a stream that may not be
    replayable (an engine paging weights in from host or disk), so shards are written under
    temporary names as they fill up and renamed to ``model-0000k-of-0000n.safetensors`` once n is
    known. At most one shard's tensors are held in memory. With one shard the file is
    ``model.safetensors`` and no index is written, as HF does. ``lm_head.weight`` is skipped when
    embeddings are tied. ``dtype`` casts every tensor (None keeps each tensor's own dtype). ``config`` is
    a :class:`LlamaConfig`, or the contents of another model's config.json (its dtype is updated).

    ``tokenizer`` (the run's: :class:`~megatrain_lightning.lightning.data.ByteTokenizer` or ``HFTokenizer``, anything
    with ``save_pretrained(dir)`` and ``token_ids``) is written beside the weights for ``AutoTokenizer``, and
    its end-of-text id goes into config.json where the config names none, so that ``generate`` stops there.
    Files get the modes of ordinary new files (0644 under umask 022).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tied = config.get("tie_word_embeddings", False) if isinstance(config, dict) else config.tie_word_embeddings
    skip = {_TIED_KEY} if tied else set()
    shards: list[tuple[Path, list[str]]] = []
    try:
        total, saved_dtype = _write_shards(named_tensors, directory, max_shard_bytes, dtype, skip, shards)
        keep = _finalize_shards(shards, directory, total)
    finally:
        for tmp, _ in shards:  # no-op after a successful rename
            tmp.unlink(missing_ok=True)
    _remove_stale(directory, keep)
    token_ids = tokenizer.token_ids if tokenizer is not None else {}
    _write_json(_config_json(config, saved_dtype or torch.float32, token_ids), directory / CONFIG_NAME)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _ordinary_file_mode(directory: Path) -> int:
    """The permission bits a file created here by ``open`` gets: 0o666 less the umask (read without
    changing it, which ``os.umask`` cannot do)."""
    probe = directory / f".mode-{uuid.uuid4().hex[:8]}"
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def _config_json(config: LlamaConfig | dict, dtype: torch.dtype, token_ids: dict[str, int | None]) -> dict:
    """config.json's contents; `token_ids` (the tokenizer's) fill the token ids the config leaves unset."""
    if not isinstance(config, dict):
        config = config.to_hf_dict(dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    unset = {k: v for k, v in token_ids.items() if config.get(k) is None}
    return {**config, **unset, "dtype": name, **({"torch_dtype": name} if "torch_dtype" in config else {})}


def save_pretrained(
    model: LlamaForCausalLM,
    directory: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
) -> None:
    """Save ``model`` (and `tokenizer`, see :func:`save_hf_checkpoint`) as a HF checkpoint that
    ``transformers.AutoModelForCausalLM`` (and ``AutoTokenizer``) load."""
    save_hf_checkpoint(model.state_dict().items(), model.config, directory, max_shard_bytes, dtype, tokenizer)
