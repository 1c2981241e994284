"""A ready LightningModule for this project's Llama-family model: loss, AdamW groups, warm-up + cosine.

The model is named the way a user thinks of it: a preset (``"llama-3.1-8b"``), a Hugging Face
``config.json`` or checkpoint directory, or a :class:`LlamaConfig`; ``overrides`` change fields
(``{"num_hidden_layers": 2}``) and ``init_from`` loads a Hugging Face checkpoint's weights to fine-tune.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from megatrain_lightning.engine import materialize
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM, load_hf_config, load_hf_weights
from megatrain_lightning.models.named import resolve_config

_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "tie_word_embeddings",
)


def check_init_from(config: LlamaConfig, init_from: str) -> None:
    """Refuse a checkpoint whose config.json has other shapes than `config`, before anything is built."""
    if not Path(init_from).expanduser().is_dir():
        raise ValueError(
            f"init_from={init_from!r} is not a directory; give a Hugging Face checkpoint directory "
            "(config.json plus model.safetensors or sharded *.safetensors with their index)"
        )
    theirs = load_hf_config(Path(init_from).expanduser())
    differ = [
        f"{k}: checkpoint {getattr(theirs, k)}, model {getattr(config, k)}"
        for k in _SHAPE_FIELDS
        if getattr(theirs, k) != getattr(config, k)
    ]
    if differ:
        raise ValueError(
            f"init_from={init_from!r} does not fit the model ({'; '.join(differ)}); drop the model's "
            "shape overrides, or leave model unset to take the checkpoint's own config"
        )


def check_optimizer_args(
    lr: Any = 3e-3,
    weight_decay: Any = 0.1,
    betas: Any = (0.9, 0.95),
    warmup_steps: Any = 0,
    max_steps: Any = None,
) -> None:
    """Refuse AdamW and schedule settings out of range, naming the value and the valid range (the Trainer
    would otherwise fail at its first step, or train with a schedule that never warms up)."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (number(lr) and lr > 0):
        raise ValueError(f"model lr={lr!r} must be a number above 0, e.g. 3e-4")
    if not (number(weight_decay) and weight_decay >= 0):
        raise ValueError(f"model weight_decay={weight_decay!r} must be a number >= 0 (0 turns it off), e.g. 0.1")
    if not (isinstance(betas, Sequence) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"model betas={betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if not (count(warmup_steps) and warmup_steps >= 0):
        raise ValueError(f"model warmup_steps={warmup_steps!r} must be an integer >= 0 (0: no warm-up)")
    if max_steps is not None and not (count(max_steps) and max_steps >= 1):
        raise ValueError(f"model max_steps={max_steps!r} must be an integer >= 1, or null for the trainer's total")


def build_model(config: LlamaConfig, init_from: str | None = None) -> LlamaForCausalLM:
    """A fresh model, or one holding the weights of the HF checkpoint directory ``init_from``."""
    if init_from is None:
        return LlamaForCausalLM(config)
    check_init_from(config, init_from)
    # Built on the meta device and materialized uninitialized: the checkpoint overwrites every weight. Under
    # init_module(empty_init=True) it stays there: the engine reads the checkpoint into its masters at setup.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if not materialize.building_empty():
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty re-creates each module's Parameter, which unties them
    load_hf_weights(model, Path(init_from).expanduser())
    return model


class CausalLMModule(L.LightningModule):
    """Next-token training of a :class:`LlamaForCausalLM` on batches of ``(input_ids, targets)``.

    Batches of ``(input_ids, targets, position_ids)`` (``TextDataModule(document_positions=True)``) hand
    their positions to the model, which reads a position that returns to 0 as the start of a new document.

    Weight decay applies to matrices only (norm weights and biases are in a no-decay group); the
    learning rate warms up linearly for ``warmup_steps`` and then follows a cosine to 10% at
    ``max_steps``.

    Args:
        model: a preset name (e.g. ``llama-3.1-8b``, ``qwen2.5-7b``, ``tiny``), a Hugging Face config.json or
            checkpoint directory, or a LlamaConfig. None: the config of ``init_from``.
        overrides: LlamaConfig fields to change, e.g. ``{num_hidden_layers: 2, loss_chunk_size: 1024}``.
        init_from: a Hugging Face checkpoint directory whose weights to start from (fine-tuning).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay of the matrices.
        betas: AdamW betas.
        warmup_steps: optimizer steps of linear warm-up.
        max_steps: optimizer steps of the cosine; None: the trainer's total (``estimated_stepping_batches``).
    """

    def __init__(
        self,
        model: str | LlamaConfig | None = None,
        overrides: dict[str, Any] | None = None,
        init_from: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: int | None = None,
    ) -> None:
        super().__init__()
        check_optimizer_args(lr, weight_decay, betas, warmup_steps, max_steps)
        if model is None and init_from is None:
            raise ValueError(
                "CausalLMModule needs model= (a preset, e.g. 'llama-3.1-8b', or a config.json) or init_from="
            )
        self.save_hyperparameters()
        self.config = resolve_config(model if model is not None else init_from, overrides)
        self.model = build_model(self.config, init_from)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        # sync_dist: with several ranks, each validates its share and val_loss is the mean over ranks (one rank: as is)
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def _loss(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Mean loss of ``(inputs, targets)`` or ``(inputs, targets, position_ids)`` (packed documents)."""
        if len(batch) not in (2, 3):
            raise ValueError(
                f"CausalLMModule takes batches of (inputs, targets) or (inputs, targets, position_ids), got "
                f"{len(batch)} items; TextDataModule(document_positions=...) gives either"
            )
        inputs, targets, *positions = batch
        return self.model(inputs, targets=targets, position_ids=positions[0] if positions else None)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        total = self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, hp.warmup_steps, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _total_steps(self) -> int:
        if self.hparams.max_steps is not None:
            return self.hparams.max_steps
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError(
                "the learning-rate schedule needs a length: set Trainer(max_steps=...) or model max_steps="
            )
        return int(total)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
