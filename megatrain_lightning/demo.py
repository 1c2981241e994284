"""The embedded demo: a small Llama learns English from text that ships with Python, with no download.

``python -m megatrain_lightning`` trains it with ``strategy="megatrain"`` (on the GPU when there is
one, else on the CPU), prints the loss as it falls, writes a Lightning checkpoint and a Hugging Face
export, and prints a sample generation.

The corpus is ``pydoc_data.topics``: ~460 kB of the Python reference documentation in English, part
of every CPython installation. Tokens are bytes (vocabulary 256), so no tokenizer is needed either.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.models import LlamaConfig, save_pretrained
from megatrain_lightning.module import CausalLMModule


def embedded_corpus() -> torch.Tensor:
    """The bytes of Python's bundled reference documentation."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class Windows(Dataset):
    """Fixed random windows of `seq_len + 1` bytes: input = window[:-1], target = window[1:]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = torch.randint(0, len(tokens) - seq_len - 1, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[self.starts[i] : self.starts[i] + self.seq_len + 1]
        return w[:-1], w[1:]


def demo_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, loss_chunk_size=1024,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=300, help="optimizer steps (default 300, ~2 min on 2 CPU cores)")
    ap.add_argument("--out", default="demo_out", help="directory for the checkpoint, HF export and logs")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args(argv)
    if args.max_steps < 1:
        ap.error(f"--max-steps={args.max_steps}: must be at least 1")
    out = Path(args.out)
    torch.manual_seed(0)
    tokens = embedded_corpus()
    split = int(0.95 * len(tokens))
    train = Windows(tokens[:split], args.seq_len, args.max_steps * args.batch_size, seed=0)
    val = Windows(tokens[split:], args.seq_len, 4 * args.batch_size, seed=1)
    module = CausalLMModule(demo_config(), max_steps=args.max_steps, warmup_steps=min(20, args.max_steps))
    gpu = torch.cuda.is_available()
    ckpt = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0)
    trainer = L.Trainer(
        strategy="megatrain", precision="bf16-mixed" if gpu else "32-true", max_steps=args.max_steps,
        gradient_clip_val=1.0, val_check_interval=max(1, args.max_steps // 3), check_val_every_n_epoch=None,
        default_root_dir=out, callbacks=[ckpt], log_every_n_steps=10,
        enable_progress_bar=os.environ.get("CI") is None,
    )  # fmt: skip
    val_loader = DataLoader(val, batch_size=args.batch_size)
    before = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    trainer.fit(module, DataLoader(train, batch_size=args.batch_size, shuffle=False), val_loader)
    after = trainer.validate(module, val_loader, verbose=False)[0]["val_loss"]
    save_pretrained(module.model, out / "hf")
    prompt = torch.tensor([list(b"The ")])
    sample = module.model.generate(prompt, max_new_tokens=120, temperature=0.8, top_k=20)[0]
    text = bytes(sample.tolist()).decode("utf-8", errors="replace")
    print(f"\nvalidation loss: {before:.3f} -> {after:.3f} (nats/byte)")
    print(f"checkpoint: {ckpt.last_model_path}\nHugging Face export: {out / 'hf'}\nsample: {text!r}")
    return {"val_loss_before": before, "val_loss_after": after, "checkpoint": ckpt.last_model_path}


if __name__ == "__main__":
    main()
