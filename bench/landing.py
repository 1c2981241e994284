"""A step's last gradient landing on the host before a global-norm clip: accumulate, then take the norms.

    python bench/landing.py [--numel 67108864] [--reps 7]

The job: a bf16 gradient added into a unit's fp32 accumulator, then the per-parameter L2 norms of the sum
(what the clip coefficient starts from), for one flat unit cut into parameters as a Llama block is (the
attention and MLP matrices of llama-3.1-8b in proportion, two norm weights).

Variants (same arrays, far beyond the last-level cache):

  two passes   kernels.accumulate_ then kernels.param_norms (torch's norms): the engine before the fused
               landing; 10 B/param (acc 4 read + 4 write, grad 2 read), then 4 B/param read again = 14
  two native   native.grad_accumulate_ then native.sq_norm per parameter: the same 14 B/param, both native
  fused        kernels.accumulate_norms_ (native.grad_accumulate_sq_norms_): each chunk's norms are read
               back from cache right after it is accumulated, so memory sees 10 B/param

B/param counts what each variant must move (write-allocate reads not counted). Each thread count (1,
then all CPUs) sets torch's and the native kernel's; every variant is warmed up, then timed --reps
times, interleaved; the table shows the median and the best. The last line is machine-readable:

    landing: fused/two_passes=<x> threads=<n>
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from megatrain_lightning.optim import kernels, native

# llama-3.1-8b's block in elements per hidden**2: q, k, v, o (1 + 1/4 + 1/4 + 1), gate, up, down (3 x 3.5)
SHARES = [1.0, 0.25, 0.25, 1.0, 3.5, 3.5, 3.5]


def block_spans(numel: int) -> list[tuple[int, int]]:
    """Two norm weights and the seven matrices of a block, in proportion, tiling `numel` exactly."""
    norm = max(1, numel // 100_000)
    rest = numel - 2 * norm
    sizes = [int(rest * s / sum(SHARES)) for s in SHARES]
    sizes[-1] += rest - sum(sizes)
    spans, off = [], 0
    for n in [norm, *sizes[:4], norm, *sizes[4:]]:
        spans.append((off, n))
        off += n
    return spans


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    if not native.available():
        raise SystemExit(f"the native kernel did not load: {native.load_error()}")
    os.environ["MEGATRAIN_CPU_ADAM"] = "native"
    n, spans = args.numel, block_spans(args.numel)
    acc = torch.randn(n)
    grad = torch.randn(n).to(torch.bfloat16)

    def two_passes():
        kernels.accumulate_(acc, grad, False)
        kernels.param_norms(acc, spans)

    def two_native():
        native.grad_accumulate_(acc, grad, False)
        [native.sq_norm(acc[o : o + k]) for o, k in spans]

    def fused():
        kernels.accumulate_norms_(acc, grad, False, spans)

    variants = {"two passes": (two_passes, 14), "two native": (two_native, 14), "fused": (fused, 10)}
    print(f"landing with norms: {n / 1e6:.1f}M params in {len(spans)} parameters; median of {args.reps} ms")
    print("| variant    | threads | median ms |  best ms | B/param |  GB/s |")
    print("|------------|---------|-----------|----------|---------|-------|")
    medians = {}
    all_threads = os.cpu_count() or 1
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        native.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps + 2):
            for name, (fn, _) in variants.items():
                acc.zero_()  # the sum stays finite and the same work is timed each time
                t0 = time.perf_counter()
                fn()
                if rep >= 2:
                    times[name].append(time.perf_counter() - t0)
        for name, (_, per_param) in variants.items():
            med = statistics.median(times[name])
            medians[(name, threads)] = med
            gbs = n * per_param / med / 1e9
            print(
                f"| {name:<10} | {threads:>7} | {med * 1e3:>9.1f} | {min(times[name]) * 1e3:>8.1f} | {per_param:>7} | {gbs:>5.1f} |"
            )
    ratio = medians[("fused", all_threads)] / medians[("two passes", all_threads)]
    print(f"landing: fused/two_passes={ratio:.2f} threads={all_threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
