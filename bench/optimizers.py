"""The host optimizer step on each path: native AdamW kernel vs torch's AdamW stepping itself vs SGD.

    python bench/optimizers.py [--width 2048] [--blocks 8] [--reps 5]

A stack of `--blocks` Linear(width, width) blocks (8 x 2048^2 = 34M parameters by default) streams through
the engine on the CPU in fp32. Each repetition runs one backward outside ``engine.backward`` (so every
gradient lands and waits for the step, on every path alike), then times ``opt.step()`` followed by
``engine.flush()``: the whole host step, from landed gradients to stepped masters and refreshed copies.

  native AdamW   torch.optim.AdamW on the engine's native kernel (engine/optimizer.py), the fast path
  torch AdamW    the same AdamW, made to step itself (a subclass whose step is torch's): the generic path
                 (engine/generic_optim.py), torch's own single-tensor AdamW over the fp32 masters
  torch SGD      SGD with momentum on the generic path

Beside each generic path, the same optimizer's ``step()`` on an ordinary model of the same shape (no engine,
gradients in ``.grad``): what ordinary training pays for it, so the difference is the engine's own cost.

The table gives the median step (and the best) and the same per billion parameters; the last line is
machine-readable: ``optimizers: native_adamw=<s/B> torch_adamw=<s/B> sgd=<s/B> threads=<n>``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from megatrain_lightning import Engine, EngineConfig


class Stack(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class SelfSteppingAdamW(torch.optim.AdamW):
    """torch's AdamW with a step of its own: the engine then calls it instead of its native kernel."""

    def step(self, closure=None):  # type: ignore[override]
        return super().step(closure)


PATHS = {
    "native AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1),
    "torch AdamW": lambda ps: SelfSteppingAdamW(ps, lr=1e-4, weight_decay=0.1),
    "torch SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}


def time_path(make, width: int, blocks: int, reps: int) -> tuple[list[float], int, str]:
    torch.manual_seed(0)
    model = Stack(width, blocks)
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width)
    times = []
    with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
        opt = engine.optimizer(make(model.parameters()))
        for rep in range(reps + 1):  # (the first allocates the state: not timed)
            model(x).square().mean().backward()
            engine.flush()
            t0 = time.perf_counter()
            opt.step()
            engine.flush()
            if rep:
                times.append(time.perf_counter() - t0)
            opt.zero_grad()
        kind = type(opt).__name__
    return times, numel, kind


def time_ordinary(make, width: int, blocks: int, reps: int) -> list[float]:
    """The optimizer's step on an ordinary model, gradients in ``.grad`` (what ordinary training pays)."""
    torch.manual_seed(0)
    model = Stack(width, blocks)
    opt = make(model.parameters())
    times = []
    for rep in range(reps + 1):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        t0 = time.perf_counter()
        opt.step()
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'path':<14} {'host optimizer':<22} {'params':>8} {'step (median)':>14} {'best':>9} {'s per 1B params':>16}"
    )
    per_b = {}
    for name, make in PATHS.items():
        times, numel, kind = time_path(make, args.width, args.blocks, args.reps)
        med = statistics.median(times)
        per_b[name] = med * 1e9 / numel
        rows = [(name, kind, times)]
        if kind != "HostAdamW":
            rows.append(("", "(no engine: ordinary)", time_ordinary(make, args.width, args.blocks, args.reps)))
        for label, what, ts in rows:
            med = statistics.median(ts)
            print(
                f"{label:<14} {what:<22} {numel / 1e6:>7.1f}M {med * 1e3:>11.1f} ms {min(ts) * 1e3:>6.1f} ms "
                f"{med * 1e9 / numel:>14.2f} s"
            )
    print(
        f"optimizers: native_adamw={per_b['native AdamW']:.2f} torch_adamw={per_b['torch AdamW']:.2f} "
        f"sgd={per_b['torch SGD']:.2f} threads={torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
