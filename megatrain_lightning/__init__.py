"""megatrain_lightning: train models larger than GPU memory on one GPU with host-resident state.

Importing the package registers ``Trainer(strategy="megatrain")`` and ``Fabric(strategy="megatrain")`` with
Lightning. ``Engine(model, EngineConfig(...))`` is the library under both, for plain PyTorch loops too.
``CausalLMModule``, ``TextDataModule`` and ``ModelCheckpoint`` are what the ``megatrain`` command's configs use.
``load_from_checkpoint(MyModule, path)`` loads any checkpoint, sharded ones included, for inference.
``load_hf_weights(model, directory)`` loads a Hugging Face safetensors checkpoint, straight into the engine's
masters for a model built with ``init_module(empty_init=True)``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from megatrain_lightning.checkpoint.callback import ModelCheckpoint
from megatrain_lightning.engine import Engine, EngineConfig, HostAdamW, HostMemoryError, PinnedMemoryError, empty_init
from megatrain_lightning.lightning.convert import load_from_checkpoint
from megatrain_lightning.lightning.data import TextDataModule
from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy
from megatrain_lightning.lightning.module import CausalLMModule
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from megatrain_lightning.models.hf_io import load_hf_weights

__version__ = "0.1.0"

MegatrainStrategy.register_strategies(StrategyRegistry)
MegatrainFabricStrategy.register_strategies()  # Fabric(strategy="megatrain")

# What users import or name in a config, kept stable from here on: the strategies, the engine and its options
# with the errors it raises, the LightningModule, the data module and the checkpoint callback the shipped
# configs use, and the loaders. Everything else is reached through its module (megatrain_lightning.engine,
# .precision, .planner, ...), which may change.
__all__ = [
    "CausalLMModule",
    "Engine",
    "EngineConfig",
    "HostAdamW",
    "HostMemoryError",
    "MegatrainFabricStrategy",
    "MegatrainStrategy",
    "ModelCheckpoint",
    "PinnedMemoryError",
    "TextDataModule",
    "empty_init",
    "load_from_checkpoint",
    "load_hf_weights",
]
