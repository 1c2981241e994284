"""Inductor's fusion of one decoder block, timed on a GPU, against the figures the schedule model takes.

    python bench/fusion.py [--model llama-3.2-1b] [--tokens 4096]

The schedule model (megatrain_lightning/schedule/fusion.py) takes what ``compile_blocks=True`` does to a block's
memory-bound GPU work from inductor's own byte counts on the CPU. On a CUDA device this script times it: one
block of --model in bf16 under autocast, its forward (in grad mode, as the engine runs it) and its backward, eager
and compiled as the engine compiles blocks, each under torch.profiler after two warm-up calls. Each CUDA kernel
counts as attention (a name with flash, fmha or attention), a matmul (gemm, nvjet, cutlass, xmma) or
memory-bound work (all else: elementwise, reductions, inductor's fused kernels). It prints per graph the
memory-bound milliseconds eager and compiled, their ratio beside the model's ratio, then one line:

    fusion: model=<m> tokens=<n> forward_measured=<r> forward_model=<r> backward_measured=<r> backward_model=<r>

Without CUDA it prints the model's ratios alone (measured: na). A ratio of times is not one of bytes: fused
kernels may run nearer to or further from the memory bandwidth than eager ones, which is what the check shows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatrain_lightning.engine.device.block_fn import compiled  # noqa: E402
from megatrain_lightning.models import LlamaConfig  # noqa: E402
from megatrain_lightning.schedule.fusion import block_call, block_fusion  # noqa: E402

ATTENTION = ("flash", "fmha", "attention")
MATMUL = ("gemm", "nvjet", "cutlass", "xmma")


def kind(kernel: str) -> str:
    name = kernel.lower()
    return (
        "attention" if any(a in name for a in ATTENTION) else "matmul" if any(m in name for m in MATMUL) else "memory"
    )


def memory_ms(run) -> float:
    """Milliseconds of memory-bound CUDA kernels `run` launches (profiled once after two warm-up calls)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels if kind(e.name) == "memory") / 1e3


def measure(config: LlamaConfig, tokens: int) -> dict[str, tuple[float, float]]:
    """Per graph (forward, backward): memory-bound milliseconds (eager, compiled) of one block on CUDA."""
    block, x, cos, sin, grad = block_call(config, tokens, torch.bfloat16, "cuda")
    params = list(block.parameters())
    compiled_forward = compiled(type(block).forward)
    out = {}
    for name, fn in (("eager", block), ("compiled", lambda *a: compiled_forward(block, *a))):

        def forward(fn=fn):
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                return fn(x, cos, sin)

        out[name] = (
            memory_ms(forward),
            memory_ms(lambda forward=forward: torch.autograd.grad(forward(), [x, *params], grad)),
        )
    # (the backward run above includes its forward: the backward alone is the difference)
    return {
        "forward": (out["eager"][0], out["compiled"][0]),
        "backward": (out["eager"][1] - out["eager"][0], out["compiled"][1] - out["compiled"][0]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="a preset (default llama-3.2-1b)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the block's one row (default 4096)")
    args = ap.parse_args(argv)
    config = LlamaConfig.from_preset(args.model)
    model = block_fusion(config)
    measured = measure(config, args.tokens) if torch.cuda.is_available() else None
    print(model.describe())
    print("| graph | eager ms | compiled ms | measured ratio | model's ratio (bytes) |")
    print("|---|---|---|---|---|")
    cells = []
    for graph in ("forward", "backward"):
        eager, fused = measured[graph] if measured else (float("nan"), float("nan"))
        ratio = f"{fused / eager:.3f}" if measured and eager > 0 else "na"
        print(f"| {graph} | {eager:.3f} | {fused:.3f} | {ratio} | {model.ratio(graph):.3f} |")
        cells.append(f"{graph}_measured={ratio} {graph}_model={model.ratio(graph):.3f}")
    print(f"fusion: model={args.model} tokens={args.tokens} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
