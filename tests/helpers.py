"""Shared pieces of the strategy tests: tiny models, fixed data, a LightningModule, a run-and-record helper."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")

VOCAB = 97


def hf_llama(layers: int = 3, **overrides: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def hf_qwen2(layers: int = 3) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def token_batches(n: int, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return f


class CausalLM(L.LightningModule):
    """An ordinary LightningModule around a causal LM; records each micro-batch's loss."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = hf_loss,
        lr: float = 1e-2,
        weight_decay: float = 0.1,
        split_decay: bool = False,
        schedule: int | None = None,
        manual: int | None = None,  # manual optimization with this many accumulation micro-batches
        manual_clip: float | None = None,
    ) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.lr, self.weight_decay, self.split_decay, self.schedule = lr, weight_decay, split_decay, schedule
        self.manual, self.manual_clip = manual, manual_clip
        self.automatic_optimization = manual is None
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss_fn(self.model, batch)
        self.losses.append(loss.detach().float().item())
        if self.manual is None:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.manual)
        if (batch_idx + 1) % self.manual == 0:
            if self.manual_clip:
                self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched = self.lr_schedulers()
            if sched is not None:
                sched.step()
        return None

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss_fn(self.model, batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(self.model, batch)

    def configure_optimizers(self) -> Any:
        params = [(n, p) for n, p in self.model.named_parameters()]
        if self.split_decay:
            groups = [
                {"params": [p for n, p in params if p.ndim >= 2]},
                {"params": [p for n, p in params if p.ndim < 2], "weight_decay": 0.0},
            ]
        else:
            groups = [p for _, p in params]
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay)
        if self.schedule is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, self.schedule))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batches: list[torch.Tensor]) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False)


@contextmanager
def quiet() -> Iterator[None]:
    """Silence the warnings every tiny CPU run triggers (few workers, no val loader, the disabled KV cache)."""
    with warnings.catch_warnings():
        for pattern in (
            ".*does not have many workers.*",
            ".*KV cache is disabled.*",
            ".*val_dataloader.*",
            ".*LeafSpec.*",
            ".*in eval mode at the start of training.*",
            ".*enable_nested_tensor is True.*",
        ):
            warnings.filterwarnings("ignore", pattern)
        yield


def trainer(strategy: Any = "megatrain", **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer: one epoch, no logger, checkpoints, progress bar or sanity validation."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    with quiet():
        return L.Trainer(**defaults)


def fit(module: CausalLM, batches: list[torch.Tensor], strategy: Any = "megatrain", **trainer_kwargs: Any) -> L.Trainer:
    """Fit quietly on the CPU; `strategy="auto"` is ordinary training; `ckpt_path` goes to `trainer.fit`."""
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    t = trainer(strategy, **trainer_kwargs)
    with quiet():
        t.fit(module, loader(batches), ckpt_path=ckpt_path)
    return t


def twin(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two identical copies of one freshly built model."""
    model = make()
    return model, copy.deepcopy(model)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| / max|b| over tensors (relative to each tensor's scale, so near-zero entries don't explode)."""
    assert a.keys() == b.keys()
    return max(
        ((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12)).item() for k in a
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def own_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    """A plain training loop over this project's Llama (next-token targets = the batch itself): the losses."""
    losses = []
    for batch in batches:
        loss = model(batch, targets=batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, megatrain_lightning.HostAdamW):
        opt.engine.flush()  # the last steps run in the background: done before the caller reads the weights
    return losses
