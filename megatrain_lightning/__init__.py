"""megatrain_lightning: train models larger than GPU memory on one GPU with host-resident state.

Importing the package registers ``Trainer(strategy="megatrain")`` and ``Fabric(strategy="megatrain")`` with
Lightning. ``Engine(model, EngineConfig(...))`` is the library under both, for plain PyTorch loops too.
``load_from_checkpoint(MyModule, path)`` loads any checkpoint, sharded ones included, for inference.
``load_hf_weights(model, directory)`` loads a Hugging Face safetensors checkpoint, straight into the engine's
masters for a model built with ``init_module(empty_init=True)``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from megatrain_lightning.convert import load_from_checkpoint
from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.engine import Engine, HostMemoryError
from megatrain_lightning.engine.materialize import empty_init
from megatrain_lightning.engine.optimizer import HostAdamW
from megatrain_lightning.engine.pinned import PinnedMemoryError
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.fabric import MegatrainFabricPrecision, MegatrainFabricStrategy
from megatrain_lightning.models.hf_io import load_hf_weights
from megatrain_lightning.precision import MegatrainPrecision
from megatrain_lightning.strategy import MegatrainStrategy

__version__ = "0.1.0"

MegatrainStrategy.register_strategies(StrategyRegistry)
MegatrainFabricStrategy.register_strategies()  # Fabric(strategy="megatrain")

__all__ = [
    "Engine",
    "EngineConfig",
    "Probes",
    "HostAdamW",
    "HostMemoryError",
    "MegatrainFabricPrecision",
    "MegatrainFabricStrategy",
    "MegatrainPrecision",
    "MegatrainStrategy",
    "PinnedMemoryError",
    "empty_init",
    "load_from_checkpoint",
    "load_hf_weights",
]
