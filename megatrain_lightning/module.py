"""A ready LightningModule for this project's Llama-family model: loss, AdamW groups, warm-up + cosine."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as L
import torch

from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM


class CausalLMModule(L.LightningModule):
    """Next-token training of a :class:`LlamaForCausalLM` on batches of ``(input_ids, targets)``.

    Weight decay applies to matrices only (norm weights and biases are in a no-decay group); the
    learning rate warms up linearly for ``warmup_steps`` and then follows a cosine to 10% at
    ``max_steps``.
    """

    def __init__(
        self,
        config: LlamaConfig,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.config = config
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.model(inputs, targets=targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", self.model(inputs, targets=targets), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, hp.warmup_steps, hp.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0.1 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
