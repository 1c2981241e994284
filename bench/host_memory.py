"""Host bytes per parameter that strategy='megatrain' actually allocates, by accounting and by RSS.

    python bench/host_memory.py [--layers 8] [--hidden 1024]

Builds this project's Llama on the CPU, hands it to the engine, runs one training step and prints the
engine's own per-buffer accounting next to the growth of the process's resident memory. The model's
own fp32 parameters (4 B/param) are released while the engine takes over, so the RSS column adds them
back: allocated = RSS after the step - RSS before the engine + 4 B/param. On a CPU-only machine the
"device" weight slots, gradient slots and outer-parameter copies are host memory too, so RSS exceeds
the accounting by about (2 slots + 2 grad slots) x one block + the outer copies.
"""

from __future__ import annotations

import argparse
import multiprocessing

import torch

from megatrain_lightning import StreamingEngine
from megatrain_lightning.callbacks import rss_bytes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.optim.adamw import HostAdamW


def measure(layers: int, hidden: int, dtype: torch.dtype) -> dict:
    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      loss_chunk_size=256)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    before = rss_bytes()
    engine = StreamingEngine(model, device="cpu", compute_dtype=dtype)
    opt = HostAdamW(torch.optim.AdamW(model.parameters(), lr=1e-4), engine)
    tokens = torch.randint(0, 1024, (1, 32))
    model(tokens, targets=tokens).backward()
    opt.step()
    engine.flush()
    acct = engine.host_bytes()
    return {"params": n, "acct": {k: v / n for k, v in acct.items()}, "rss": (rss_bytes() - before) / n + 4}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    print("| compute dtype | params | master | adam m+v | copy | grad slab | total (accounting) | allocated (RSS) |")
    print("|---|---|---|---|---|---|---|---|")
    ctx = multiprocessing.get_context("spawn")  # a fresh process per run, so RSS figures don't mix
    for dtype in (torch.bfloat16, torch.float32):
        with ctx.Pool(1) as pool:
            r = pool.apply(measure, (args.layers, args.hidden, dtype))
        a = r["acct"]
        total = sum(a.values())
        print(f"| {str(dtype).split('.')[-1]} | {r['params'] / 1e6:.1f}M | {a['master']:.2f} | {a['adam']:.2f} | "
              f"{a['copy']:.2f} | {a['slab']:.2f} | {total:.2f} B/param | {r['rss']:.2f} B/param |")  # fmt: skip


if __name__ == "__main__":
    main()
