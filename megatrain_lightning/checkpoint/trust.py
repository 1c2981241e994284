"""Reading Lightning's trainer state back without running anything stored with it.

A checkpoint may come from anywhere (a shared bucket, a colleague, a download), so nothing this project
reads from storage goes through an unrestricted unpickler:

- the commit marker and ``index.json`` are JSON (the marker's pickle frame is parsed by hand, never
  unpickled), the shards and buffers are safetensors read with our own parser;
- ``trainer.pt``, Lightning's trainer state (loops, callbacks, LR schedulers, hyper-parameters, the
  strategy's RNG state), is checked against the CRC32 that ``index.json`` records for it, *then* read
  with ``torch.load(weights_only=True)``: tensors, numbers, strings, containers and the few classes in
  :data:`TRAINER_GLOBALS`, nothing else.

Why ``torch.load(weights_only=True)`` rather than rewriting the trainer state as safetensors + JSON: the
state is whatever Lightning and the user's callbacks put there (nested dicts of tensors, tuples such as
Python's RNG state, ``inf`` in a scheduler's state, hyper-parameters of any type), and only the pickle
format keeps all of it as it was; torch's restricted unpickler accepts exactly the builtin types plus the
classes registered, and building an allowed class never calls its ``__init__`` or anything it names.
A fit with ``ModelCheckpoint``, ``EarlyStopping``, LR schedulers (LambdaLR, OneCycleLR, SequentialLR,
ReduceLROnPlateau) and :class:`~megatrain_lightning.lightning.module.CausalLMModule`'s hyper-parameters needs no
class at all; :data:`TRAINER_GLOBALS` adds the ones typical ``save_hyperparameters`` arguments bring.

A trainer state needing any other class is refused with one line naming the file and the class. A user
who trusts the file allows the class deliberately, with torch's own switch, before loading::

    torch.serialization.add_safe_globals([my_package.MyConfig])

``weights_only=False`` (``load_from_checkpoint``, ``Trainer.fit``) does not lift this for a sharded
checkpoint: it is Lightning's choice for its single files, where it means "I trust this file".
"""

from __future__ import annotations

import argparse
import datetime
import io
import pathlib
import pickle
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatrain_lightning.models.config import LlamaConfig

TRAINER_GLOBALS: list[Any] = [
    LlamaConfig,  # CausalLMModule(model=LlamaConfig(...)) keeps it in its hyper-parameters
    pathlib.PosixPath,  # paths among hyper-parameters (data directories, init_from)
    pathlib.WindowsPath,
    argparse.Namespace,  # hyper-parameters saved from an argparse script
    datetime.timedelta,  # e.g. a time budget among hyper-parameters
]
"""The classes besides torch's defaults that a trainer state may hold (see the module docstring)."""


class RefusedGlobal(ValueError):
    """The stored pickle names a class or function that is not allowed; ``name`` is its dotted name."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@contextmanager
def allowed() -> Iterator[None]:
    """torch's restricted unpickler, also accepting :data:`TRAINER_GLOBALS` (on top of whatever the user
    allowed with ``torch.serialization.add_safe_globals``)."""
    with torch.serialization.safe_globals(TRAINER_GLOBALS):
        yield


def load_restricted(raw: bytes) -> Any:
    """`raw` (a ``torch.save`` file) unpickled with the restricted unpickler; :class:`RefusedGlobal` for a
    class or function not allowed, ``ValueError`` naming the reason for bytes that are no such file."""
    try:
        with allowed():
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        name = refused_global(err)
        if name is not None:
            raise RefusedGlobal(name) from None
        raise ValueError(f"not a readable torch.save file ({first_line(err)})") from None
    except (RuntimeError, EOFError, KeyError, IndexError, TypeError, AttributeError, struct.error) as err:
        raise ValueError(f"not a readable torch.save file ({type(err).__name__}: {first_line(err)})") from None


def refused_global(err: BaseException) -> str | None:
    """The dotted name of the global that torch's weights-only unpickler refused, if that is what `err` is."""
    found = re.search(r"unsupported (?:global: )?GLOBAL ([\w.]+)", str(err), re.IGNORECASE)
    return found.group(1) if found else None


def refusal(path: str, name: str, what: str = "the trainer state") -> str:
    """One line: `path` needs the global `name`, and how to allow it deliberately."""
    return (
        f"{path}: {what} needs {name}, which checkpoints are not allowed to unpickle (it could run "
        f"code); if you trust this file, allow it before loading: torch.serialization.add_safe_globals([{name}])"
    )


def first_line(err: BaseException) -> str:
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else type(err).__name__
