"""megatrain_lightning: train models larger than GPU memory on one GPU with host-resident state.

Importing the package registers ``Trainer(strategy="megatrain")`` and ``Fabric(strategy="megatrain")`` with
Lightning. ``Engine(model, EngineConfig(...))`` is the library under both, for plain PyTorch loops too.
``CausalLMModule``, ``TextDataModule`` and ``ModelCheckpoint`` are what the ``megatrain`` command's configs use.
``load_from_checkpoint(MyModule, path)`` loads any checkpoint, sharded ones included, for inference.
``load_hf_weights(model, directory)`` loads a Hugging Face safetensors checkpoint, straight into the engine's
masters for a model built with ``init_module(empty_init=True)``.

Importing the package imports no Lightning (about 4 s of CPU): a process that only plans, schedules, converts,
drives a Ray job or runs the engine in a plain loop never pays for it. The names below load on first use, and
the strategies are registered with Lightning's registries the moment Lightning has been imported (at once when
it already has): ``import megatrain_lightning`` before or after ``import lightning`` works the same.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

# What users import or name in a config, kept stable from here on: the strategies, the engine and its options
# with the errors it raises, the LightningModule, the data module and the checkpoint callback the shipped
# configs use, and the loaders. Everything else is reached through its module (megatrain_lightning.engine,
# .precision, .planner, ...), which may change. Each name -> the module that defines it.
_EXPORTS = {
    "CausalLMModule": "megatrain_lightning.lightning.module",
    "Engine": "megatrain_lightning.engine",
    "EngineConfig": "megatrain_lightning.engine",
    "HostAdamW": "megatrain_lightning.engine",
    "HostMemoryError": "megatrain_lightning.engine",
    "MegatrainFabricStrategy": "megatrain_lightning.lightning.fabric",
    "MegatrainStrategy": "megatrain_lightning.lightning.strategy",
    "ModelCheckpoint": "megatrain_lightning.checkpoint.callback",
    "PinnedMemoryError": "megatrain_lightning.engine",
    "TextDataModule": "megatrain_lightning.lightning.data",
    "empty_init": "megatrain_lightning.engine",
    "load_from_checkpoint": "megatrain_lightning.lightning.convert",
    "load_hf_weights": "megatrain_lightning.models.hf_io",
}
__all__ = sorted(_EXPORTS)

STRATEGY_NAME = "megatrain"
_DESCRIPTION = "host-resident full-precision training, streaming blocks"


def __getattr__(name: str) -> Any:
    """An exported name, or a subpackage (``megatrain_lightning.engine``), imported on first use."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def _trainer_strategy(**kwargs: Any) -> Any:
    from megatrain_lightning.lightning.strategy import MegatrainStrategy

    return MegatrainStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy

    return MegatrainFabricStrategy(**kwargs)


def register_strategies() -> None:
    """``strategy="megatrain"`` in Lightning's Trainer and Fabric registries (both hold a factory that imports the
    strategy class on first use: registering needs Lightning's registries only, never this package's modules,
    which may be the very ones importing Lightning at that moment)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for registry, factory in ((StrategyRegistry, _trainer_strategy), (STRATEGY_REGISTRY, _fabric_strategy)):
        if STRATEGY_NAME not in registry:
            registry.register(STRATEGY_NAME, factory, description=_DESCRIPTION)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then` once the module `name` has been executed in full (a one-time import hook: it finds the module
    with the other finders, and wraps only their loader's ``exec_module``)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Any) -> None:
        self._loader, self._then = loader, then

    def __getattr__(self, name: str) -> Any:  # resource readers, get_data, ...: the wrapped loader's own
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._then()


if "lightning" in sys.modules:
    register_strategies()
elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    # (`lightning`'s own __init__ imports both lightning.fabric and lightning.pytorch, so at its end both
    # registries exist, whichever submodule the user imported)
    sys.meta_path.insert(0, _AfterImport("lightning", register_strategies))
