"""The engine's host-side cost per block call, where the model's own work is negligible.

    python bench/block_overhead.py [--layers 32] [--micro 4] [--steps 6] [--precision 32-true] [--profile N]

On an H200 a 1.24B model's 32k-token step was bound by issuing work, not by the GPU (docs/benchmarks.md, "The
second GPU"): the thread issuing a block's backward spent about 7.5 ms per block call where the GPU spent
3-4.5 ms. This measures what the engine adds to each block call on the CPU, with the "tiny" preset of this
project's Llama at a very short sequence, so that the blocks' arithmetic is small beside the Python around it:
the same plain accumulation loop (``--micro`` micro-batches per step, clipped by norm) with the engine and
without it (ordinary training, torch.optim.AdamW), each step timed, the first (warm-up) dropped, the median
reported; the difference per block call (forward and backward of one block in one micro-batch) is the
engine's overhead. ``--profile N`` prints cProfile's N most expensive functions of the engine's timed steps.

Prints a table, then one line:

    block_overhead: engine_ms_per_block_call=<x> ordinary_ms_per_block_call=<y> overhead_ms=<x - y>
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

SEQ, ROWS = 8, 1


def batches(n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (ROWS, SEQ), generator=g) for _ in range(n)]


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
    return model(batch, targets=targets)


def run(
    model: torch.nn.Module, engine_config: EngineConfig | None, args: argparse.Namespace, profile=None
) -> list[float]:
    """Each step's seconds, the plain loop with the engine (`engine_config`) or without it (None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = None if engine_config is None else Engine(model, engine_config)
    if engine is not None:
        opt = engine.optimizer(opt)
    data = batches(args.micro * args.steps, model.config.vocab_size)
    times = []
    for step in range(args.steps):
        on = profile is not None and step > 0
        t0 = time.perf_counter()
        if on:
            profile.enable()
        for m in range(args.micro):
            last = m == args.micro - 1
            context = nullcontext() if engine is None else engine.backward(accumulate=not last, clip=True)
            with engine.autocast() if engine is not None else nullcontext():
                loss = loss_of(model, data[step * args.micro + m])
            with context:
                (loss / args.micro).backward()
        if engine is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if engine is not None:
            engine.flush()  # (the host's step done: each step timed whole)
        if on:
            profile.disable()
        times.append(time.perf_counter() - t0)
    if engine is not None:
        engine.close()
    return times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (default 4)")
    ap.add_argument("--steps", type=int, default=6, help="steps, the first a warm-up (default 6)")
    ap.add_argument(
        "--precision", default="32-true", help="the engine's precision (default 32-true: the ordinary run's)"
    )
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions of the engine")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the model's ops are tiny: threads only add noise
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig.from_preset("tiny", num_hidden_layers=args.layers))
    calls = args.layers * args.micro
    ordinary = statistics.median(run(copy.deepcopy(base), None, args))
    profile = cProfile.Profile() if args.profile else None
    config = EngineConfig(device="cpu", precision=args.precision)
    engine = statistics.median(run(copy.deepcopy(base), config, args, profile))
    print(f"# tiny Llama, {args.layers} layers, {ROWS} x {SEQ} tokens, {args.micro} micro-batches per step, clipped; ")
    print(f"# torch {torch.__version__}, 1 thread; median of {args.steps - 1} steps after a warm-up")
    print("| run | step ms | ms per block call |")
    print("|---|---|---|")
    print(f"| ordinary (fp32, torch.optim.AdamW) | {ordinary * 1e3:.1f} | {ordinary * 1e3 / calls:.3f} |")
    print(f"| engine ({args.precision}, device cpu) | {engine * 1e3:.1f} | {engine * 1e3 / calls:.3f} |")
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    e, o = engine * 1e3 / calls, ordinary * 1e3 / calls
    print(
        f"block_overhead: engine_ms_per_block_call={e:.3f} ordinary_ms_per_block_call={o:.3f} overhead_ms={e - o:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
