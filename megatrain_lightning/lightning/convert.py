"""Sharded checkpoints outside the strategy: load one for inference, or convert it.

A sharded checkpoint (``strategy="megatrain"``'s default format, see :mod:`megatrain_lightning.checkpoint`)
is a commit marker plus per-block shards, which ``torch.load`` cannot read, so ``MyModule.load_from_checkpoint``
cannot either. Here:

- :func:`load_from_checkpoint` assembles Lightning's usual checkpoint (the trainer state with a full
  ``state_dict`` of the fp32 masters and buffers) in memory and hands it to Lightning's own
  ``MyModule.load_from_checkpoint``, so hyper-parameters, ``**kwargs`` overrides, ``on_load_checkpoint``
  and strict key checking behave exactly as there. A plain Lightning file goes to Lightning unchanged.
- :func:`to_lightning` writes Lightning's single file: weights (fp32, as trained), trainer state and,
  when the checkpoint holds it, the Adam state in ``torch.optim.AdamW``'s layout, so ordinary strategies
  resume from it.
- :func:`to_hf` writes a Hugging Face directory (config.json + safetensors) of this project's Llama or
  of a ``transformers`` model, streamed one shard at a time, with the run's tokenizer when its data module
  was a :class:`~megatrain_lightning.lightning.data.TextDataModule`.

Every file is checked against its checksum on the way, and nothing read is unpickled by an unrestricted
unpickler (:mod:`megatrain_lightning.checkpoint.trust`). ``storage_options`` (credentials, endpoint) go to
fsspec for the checkpoint, and for the file written; they are written nowhere.
"""

from __future__ import annotations

import functools
import io
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import IO, Any, TypeVar

import lightning.pytorch as L
import torch
from fsspec.implementations.local import LocalFileSystem

from megatrain_lightning.checkpoint import store, trust
from megatrain_lightning.checkpoint.rereads import filesystem
from megatrain_lightning.checkpoint.store import CheckpointError

T = TypeVar("T", L.LightningModule, L.LightningDataModule)

# The dtypes to_hf writes weights in, by their option name (`--dtype`).
HF_EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_from_checkpoint(
    cls: type[T],
    checkpoint_path: str | os.PathLike | IO,
    map_location: Any = None,
    hparams_file: str | os.PathLike | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` that also reads sharded checkpoints, in any process
    (no Trainer, no strategy, no GPU needed).

    The arguments are Lightning's: hyper-parameters come from the checkpoint and ``kwargs`` override them,
    ``on_load_checkpoint`` is called, ``strict`` checks the keys; the module is returned as Lightning
    returns it (on the CPU unless `map_location` says otherwise, in training mode: call ``.eval()`` for
    inference). The weights are the fp32 masters, exactly as trained.

    `weights_only` is passed to Lightning for a single-file checkpoint. A sharded checkpoint's trainer state is
    always checksummed and read by torch's restricted unpickler, even with ``weights_only=False``: allow a class
    its hyper-parameters need with ``torch.serialization.add_safe_globals`` (the error names it).
    `storage_options` go to fsspec to read a sharded checkpoint (e.g. S3 credentials).

    A :class:`~megatrain_lightning.lightning.module.CausalLMModule` fine-tuned with ``init_from`` is built without
    reading ``init_from`` again (the checkpoint holds every weight, and the directory may be gone).

    Memory: the fp32 weights are held about three times at the peak (the assembled checkpoint, its
    serialized form and the module), 12 bytes per parameter, less than the 16 training needed.
    """
    if not (isinstance(cls, type) and issubclass(cls, (L.LightningModule, L.LightningDataModule))):
        raise TypeError(f"load_from_checkpoint(cls, path): cls must be a LightningModule class, got {cls!r}")
    sharded = isinstance(checkpoint_path, (str, os.PathLike)) and store.is_checkpoint(
        str(checkpoint_path), storage_options
    )
    if not sharded:
        return cls.load_from_checkpoint(
            checkpoint_path,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )
    url = str(checkpoint_path)
    with_weights = issubclass(cls, L.LightningModule)
    read = functools.partial(_assemble, url, weights=with_weights, optimizer=False, storage_options=storage_options)
    checkpoint, index = store.reread_if_replaced(url, read, storage_options)  # again if a newer save replaced it
    if with_weights:
        _skip_init_from(cls, checkpoint, index, kwargs, url)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    with trust.allowed():  # the bytes just made from what the restricted unpickler read: the same classes
        return cls.load_from_checkpoint(
            buffer,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )


def lightning_checkpoint(
    url: str, *, optimizer: bool = True, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sharded checkpoint at `url` as Lightning's checkpoint dict: the trainer state, ``state_dict``
    (fp32 masters and buffers, tied parameters under each of their names) and, when `optimizer` and the
    checkpoint holds Adam state, ``optimizer_states`` in ``torch.optim.AdamW.state_dict()``'s layout."""
    url = _sharded(url, storage_options)
    read = functools.partial(_assemble, url, weights=True, optimizer=optimizer, storage_options=storage_options)
    return store.reread_if_replaced(str(url), read, storage_options)[0]  # again if a newer save replaced it


def to_lightning(url: str, out: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """Write the sharded checkpoint at `url` as Lightning's single-file checkpoint `out` (local path or
    fsspec URL; `storage_options` serve both); returns a one-line summary. `out` appears complete or not
    at all."""
    url, out = _sharded(url, storage_options), str(out)
    _check_target(url, out, storage_options)
    checkpoint = lightning_checkpoint(url, optimizer=True, storage_options=storage_options)
    fs, path = filesystem(out, storage_options)
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        raw = io.BytesIO()
        torch.save(checkpoint, raw)
        fs.pipe_file(path, raw.getvalue())  # one object write
    unique = {id(t): t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)}  # tied: once
    n = sum(t.numel() for t in unique.values())
    state = "with the optimizer state" if "optimizer_states" in checkpoint else "weights only (no optimizer state)"
    return f"wrote {out}: Lightning checkpoint of {n:,} values (weights in fp32 as trained), {state}"


def to_hf(
    url: str,
    out: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write the model of the sharded checkpoint at `url` as a Hugging Face directory `out` (local; config.json
    + safetensors), one shard in memory at a time; `dtype` None keeps the fp32 masters, "bf16" casts. The
    tokenizer the run's TextDataModule read its text with (bytes, or its tokenizer.json) goes beside them, for
    ``AutoTokenizer``; the summary returned says whether it did and why not."""
    from megatrain_lightning.models import save_hf_checkpoint

    url = _sharded(url, storage_options)
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{out} exists and is not a directory; the Hugging Face format is a directory")
    if isinstance(dtype, str):
        if dtype not in HF_EXPORT_DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(HF_EXPORT_DTYPES)}")
        dtype = HF_EXPORT_DTYPES[dtype]
    fs, vdir, index = store.read_index(url, storage_options)
    export = index.get("export") or _export_from_hparams(fs, vdir, index, url)
    if isinstance(export, dict) and export.get("config") is None:
        export = None
    if export is None:
        raise CheckpointError(
            f"{url}: cannot write a Hugging Face directory for this model: supported are this project's "
            "LlamaForCausalLM (e.g. CausalLMModule) and transformers PreTrainedModel models inside the "
            "LightningModule; convert it with --to torch and save the weights from the loaded module instead"
        )
    _check_export(export, url)
    config: Any = _llama_config(export, url) if export["library"] == "megatrain" else export["config"]
    prefix = export["prefix"]
    aliases = set(index.get("aliases") or {})

    def named() -> Any:
        for rec in index["units"]:
            master = store.read_unit(fs, vdir, rec)["master"]
            for p in rec["params"]:
                if p["name"].startswith(prefix):
                    yield p["name"][len(prefix) :], _view(master, p)
        for name, t in store.read_buffers(fs, vdir, index).items():
            if name.startswith(prefix) and name not in aliases:
                yield name[len(prefix) :], t

    tokenizer, tokenizer_note = _run_tokenizer(store.read_trainer_state(fs, vdir, index))
    save_hf_checkpoint(named(), config, out, max_shard_bytes, dtype, tokenizer)
    kind = export["config"]["architectures"][0]
    return f"wrote {out}: Hugging Face {kind} in {str(dtype or torch.float32).removeprefix('torch.')}, {tokenizer_note}"


def _run_tokenizer(trainer_state: dict) -> tuple[Any, str]:
    """The tokenizer of the run's data module (from its saved hyper-parameters), and a note for the summary."""
    from megatrain_lightning.lightning.data import ByteTokenizer, tokenizer_of

    hparams = trainer_state.get("datamodule_hyper_parameters") or {}
    try:
        tokenizer = tokenizer_of(hparams)
    except (FileNotFoundError, ImportError, ValueError) as err:
        return None, f"no tokenizer ({err})"
    if tokenizer is None:
        return None, "no tokenizer (the run had no TextDataModule tokenizing text; save yours into the folder)"
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer, "with its byte tokenizer"
    return tokenizer, f"with its tokenizer {hparams['tokenizer']}"


# -- assembling Lightning's checkpoint ---------------------------------------------------------------
def _sharded(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """`url` if it is a sharded checkpoint, intact or not (its readers explain any damage); otherwise a
    CheckpointError saying what it is instead."""
    url = str(url)
    if store.is_checkpoint(url, storage_options):
        return url
    fs, path = filesystem(url, storage_options)
    if fs.isdir(path):
        raise CheckpointError(f"{url} is a directory; give the checkpoint's file (e.g. .../checkpoints/last.ckpt)")
    if not fs.exists(path):
        raise CheckpointError(f"no checkpoint at {url}")
    raise CheckpointError(
        f"{url} is not a sharded megatrain checkpoint (it has no commit marker); a Lightning single-file "
        "checkpoint needs no conversion: it loads with MyModule.load_from_checkpoint or a Trainer's ckpt_path"
    )


def _assemble(
    url: str, *, weights: bool, optimizer: bool, storage_options: dict[str, Any] | None = None
) -> tuple[dict, dict]:
    fs, vdir, index = store.read_index(url, storage_options)
    checkpoint = store.read_trainer_state(fs, vdir, index)
    if not weights:
        return checkpoint, index
    order = index.get("param_order")
    with_adam = optimizer and index["optimizer"]
    if with_adam and (order is None or not index.get("param_groups")):
        warnings.warn(
            f"{url} was written before checkpoints recorded the optimizer's parameter order: converting the "
            "weights and trainer state only, so training cannot resume from the result (re-save the checkpoint "
            "with this version to keep the optimizer state)",
            stacklevel=3,
        )
        with_adam = False
    state_dict: dict[str, torch.Tensor] = {}
    adam: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
    groups: dict[str, int | None] = {}
    for rec in index["units"]:
        flat = store.read_unit(fs, vdir, rec, adam=with_adam)
        for p in rec["params"]:
            state_dict[p["name"]] = _view(flat["master"], p).clone()
            groups[p["name"]] = p.get("group")
            step = store.param_step(rec, p)
            if "exp_avg" in flat and step > 0:
                adam[p["name"]] = (step, _view(flat["exp_avg"], p).clone(), _view(flat["exp_avg_sq"], p).clone())
        del flat  # one unit's flat buffers at a time
    buffers = store.read_buffers(fs, vdir, index)
    aliases = index.get("aliases")
    if aliases is None:
        aliases = _aliases_among_buffers(buffers, state_dict)
    for alias, name in aliases.items():
        buffers.pop(alias, None)
        state_dict[alias] = state_dict[name]
    checkpoint["state_dict"] = {**state_dict, **buffers}
    exact_groups = checkpoint.pop("megatrain_param_groups", None)  # the settings as saved (the index's are JSON)
    if with_adam:
        checkpoint["optimizer_states"] = [_adamw_state(order, groups, exact_groups or index["param_groups"], adam)]
    else:
        checkpoint.pop("optimizer_states", None)
    return checkpoint, index


def _view(flat: torch.Tensor, p: dict) -> torch.Tensor:
    return flat[p["offset"] : p["offset"] + math.prod(p["shape"])].view(p["shape"])


def _aliases_among_buffers(buffers: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> dict[str, str]:
    """Checkpoints written before the index named tied parameters kept the tie's second name (as the
    compute copy, maybe bf16) among the buffers: find those, to give them the fp32 master instead."""
    found = {}
    for name, buf in buffers.items():
        for pname, p in params.items():
            if buf.shape == p.shape and buf.is_floating_point() and torch.equal(buf, p.to(buf.dtype)):
                found[name] = pname
                break
    return found


def _adamw_state(order: list[str], groups: dict[str, int | None], param_groups: list[dict], adam: dict) -> dict:
    """``torch.optim.AdamW.state_dict()``: parameters numbered in the optimizer's order, state only for
    those that stepped (as torch.optim keeps it)."""
    state = {}
    for i, name in enumerate(order):
        if name in adam:
            step, m, v = adam[name]
            state[i] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
    saved = []
    for g, group in enumerate(param_groups):
        settings = {k: tuple(v) if k == "betas" else v for k, v in group.items()}
        saved.append({**settings, "params": [i for i, name in enumerate(order) if groups.get(name) == g]})
    return {"state": state, "param_groups": saved}


def _skip_init_from(cls: type, checkpoint: dict, index: dict, kwargs: dict, url: str) -> None:
    """CausalLMModule(init_from=DIR) reads DIR's weights when built; the checkpoint replaces them all."""
    from megatrain_lightning.lightning.module import CausalLMModule

    hp = checkpoint.get("hyper_parameters") or {}
    if not (issubclass(cls, CausalLMModule) and hp.get("init_from") and "init_from" not in kwargs):
        return
    export = index.get("export") if isinstance(index.get("export"), dict) else {}
    if hp.get("model") is not None or "model" in kwargs:
        kwargs["init_from"] = None
    elif export.get("library") == "megatrain":
        _check_export(export, url)
        kwargs.update(init_from=None, model=_llama_config(export, url), overrides=None)


def _check_export(export: Any, url: str) -> None:
    """The index's description of the model to export is one a save wrote (the index is checksummed, but a
    deliberate editor reseals it): a CheckpointError line otherwise, before anything is built from it."""
    bad = None
    if not isinstance(export, dict) or export.get("library") not in ("megatrain", "transformers"):
        bad = "does not name a library (megatrain or transformers)"
    elif not isinstance(export.get("prefix"), str) or not isinstance(export.get("config"), dict):
        bad = "lacks the prefix or the config"
    elif not (isinstance(export["config"].get("architectures"), list) and export["config"]["architectures"]):
        bad = "config lacks 'architectures'"
    elif export["library"] == "megatrain" and not isinstance(export.get("llama_config"), dict):
        bad = "lacks 'llama_config'"
    if bad is not None:
        raise CheckpointError(f"{url}: the index's 'export' {bad}: the index is damaged or altered")


def _llama_config(export: dict, url: str) -> Any:
    """The LlamaConfig the index's export records; unknown keys and values the config refuses are one line."""
    import dataclasses

    from megatrain_lightning.models import LlamaConfig

    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(export["llama_config"]) - known)
    if unknown:
        raise CheckpointError(
            f"{url}: the index's export.llama_config has keys {unknown[:5]} that LlamaConfig does not have: the "
            "index is damaged or altered, or was written by a newer version (convert it with that version)"
        )
    try:
        return LlamaConfig(**export["llama_config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{url}: the index's export.llama_config is refused: {trust.first_line(err)}") from None


def _export_from_hparams(fs: Any, vdir: str, index: dict, url: str) -> dict | None:
    """Checkpoints written before the index described the model: a CausalLMModule's hyper-parameters do."""
    import dataclasses

    from megatrain_lightning.lightning.module import resolve_config

    hp = store.read_trainer_state(fs, vdir, index).get("hyper_parameters") or {}
    names = [p["name"] for rec in index["units"] for p in rec["params"]]
    if not ({"model", "overrides", "init_from"} <= set(hp) and any(n.startswith("model.model.layers.") for n in names)):
        return None
    try:
        config = resolve_config(hp["model"] if hp["model"] is not None else hp["init_from"], hp["overrides"])
    except (ValueError, FileNotFoundError) as err:
        raise CheckpointError(f"{url}: the model's config cannot be rebuilt from its hyper-parameters: {err}") from None
    return {
        "library": "megatrain",
        "prefix": "model.",
        "config": config.to_hf_dict(),
        "llama_config": dataclasses.asdict(config),
    }


def _check_target(url: str, out: str, storage_options: dict[str, Any] | None) -> None:
    fs, src = filesystem(url, storage_options)
    ofs, dst = filesystem(out, storage_options)
    local = isinstance(fs, LocalFileSystem) and isinstance(ofs, LocalFileSystem)
    if (os.path.abspath(src) == os.path.abspath(dst)) if local else (type(fs) is type(ofs) and src == dst):
        raise ValueError(f"{out} is the checkpoint being converted; write to another path")
    if ofs.isdir(dst):
        raise ValueError(f"{out} is a directory; give the file to write (e.g. {out.rstrip('/')}/model.ckpt)")
    if store.is_checkpoint(out, storage_options):
        raise ValueError(f"{out} is a sharded checkpoint; write elsewhere, or remove it first (checkpoint.remove)")
