"""What the engine's self-checks (engine/self_checks.py) cost: a training step's time with and without them.

    python bench/self_checks.py [--hidden 256] [--layers 4] [--seq 256] [--batch 4] [--steps 12]

This project's Llama on the CPU (32-true, a plain loop: forward, backward, AdamW step). "off" replaces the
engine's per-call checks (the fingerprint of each block call's outputs in the forward and in the recompute,
the walk over each block's parameters and buffers) with no-ops; "on" is the engine as shipped. The two
alternate step by step (drift hits both alike) after two warm-up steps each; the table gives the median
and the best step. On a busy machine the difference of two step times is noise; "inside" is the time
spent in the checks themselves (timed around each call) as a share of the step, which noise barely
moves. The last line is machine-readable:

    self_checks: on_s=<median> off_s=<median> overhead=<percent>% inside=<percent>%
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM


def step_time(model: torch.nn.Module, opt, engine: Engine, batch: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = model(batch, targets=batch)
    with engine.backward():
        loss.backward()
    opt.step()
    opt.zero_grad()
    engine.flush()  # the steps run in the background: the step ends when the last one has
    return time.perf_counter() - t0


def switch(engine: Engine, on: bool, saved: dict, spent: list[float]) -> None:
    """Turn the per-call checks on (the engine's own methods, timed into `spent`) or off (no-ops)."""
    checks = engine.checks
    for name in ("forward_done", "recompute_done", "adopted"):
        saved.setdefault(name, getattr(checks, name))
        setattr(checks, name, timed(saved[name], spent) if on else (lambda *a, **k: None))


def timed(fn, spent: list[float]):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset(
        "tiny",
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        loss_chunk_size=args.seq,
    )
    model = LlamaForCausalLM(cfg)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    saved: dict = {}
    times: dict[bool, list[float]] = {True: [], False: []}
    inside: list[float] = []  # per "on" step, the seconds spent in the checks themselves
    for i in range(2 * (args.steps + 2)):
        on, spent = i % 2 == 0, [0.0]
        switch(engine, on, saved, spent)
        t = step_time(model, opt, engine, batch)
        if i >= 4:
            times[on].append(t)
            if on:
                inside.append(spent[0] / t)
    switch(engine, True, saved, [0.0])
    engine.close()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f}M parameters, {args.layers} blocks, batch {args.batch} x {args.seq}, CPU 32-true")
    print("| checks | median s | best s |\n|---|---|---|")
    for on in (True, False):
        print(f"| {'on' if on else 'off'} | {statistics.median(times[on]):.4f} | {min(times[on]):.4f} |")
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    share = statistics.median(inside)
    print(f"time inside the checks: {100 * share:.2f}% of an 'on' step (median)")
    print(
        f"self_checks: on_s={on_s:.4f} off_s={off_s:.4f} overhead={100 * (on_s / off_s - 1):.2f}% "
        f"inside={100 * share:.2f}%"
    )


if __name__ == "__main__":
    main()
