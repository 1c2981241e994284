"""CPU optimizer step: native fused AdamW kernel vs torch's fused CPU AdamW vs a memory-bandwidth ceiling.

    python bench/cpu_adam.py [--numel 67108864] [--reps 7]

The job is the host side of one optimizer step for one flat block of parameters: fp32 master weights,
fp32 Adam m and v, a bf16 gradient coming from the GPU, and a bf16 copy of the new master going back.

Variants (all on the same 64M-parameter arrays, far beyond the last-level cache):

  torch fused  grad_f32.copy_(grad_bf16); torch.optim.AdamW(fused=True).step(); copy_bf16.copy_(master)
               bytes/param: cast 2 read + 4 write, step 16 read (master, m, v, grad fp32) + 12 write,
               copy 4 read + 2 write = 40 B/param
  native       megatrain_lightning.optim.native.adamw_step_(master, m, v, grad_bf16, copy_bf16, ...)
               bytes/param: 12 read (master, m, v) + 2 read (grad bf16) + 12 write (master, m, v)
               + 2 write (copy bf16) = 28 B/param
  native peek  native.adamw_peek_(...): the same step's bf16 copy alone, master, m and v only read (a
               speculative step): 12 read + 2 read (grad) + 2 write (copy) = 16 B/param
  peek (copies)  kernels.peek_in_scratch: each 1M-element chunk of master, m and v copied into scratch and
               stepped there by the native step, the other way to leave them unwritten: 28 B/param of the
               step's plus 24 of the copies = 52 B/param
  triad        a = b + s*c over three fp32 arrays (torch.add(b, c, alpha=s, out=a)),
               bytes/element: 8 read + 4 write = 12 B
  triad (in place)  b = b + s*c (b.add_(c, alpha=s)): the same 12 B/element, in the optimizer's
               read-modify-write pattern, where the CPU does not have to read the destination line
               before writing it (no write-allocate traffic), so it usually runs faster
  Write-allocate reads are not counted for any variant (STREAM's convention). The bandwidth ceiling
  is the faster of the two triads at the same thread count.

GB/s = those bytes / time; "params/s" compares the two optimizer variants on the same work. Each
thread count (1, then all CPUs) sets both torch.set_num_threads and native.set_num_threads. Every
variant is warmed up, then timed --reps times, interleaved with the others (so drift hits them alike);
the table reports the median (and the best). The last line is machine-readable:

    cpu_adam: native/torch_fused=<x> native/ceiling=<y> threads=<n>

for the all-threads run (ratios of medians: time ratio, and native GB/s over triad GB/s).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from megatrain_lightning.optim import kernels, native

BYTES_NATIVE = 12 + 2 + 12 + 2
BYTES_PEEK = 12 + 2 + 2
BYTES_PEEK_COPIES = BYTES_NATIVE + 3 * 8  # (each chunk's copy: 4 read + 4 written, in three arrays)
BYTES_TORCH_FUSED = (2 + 4) + (16 + 12) + (4 + 2)
BYTES_TRIAD = 8 + 4

LR, BETA1, BETA2, EPS, WD = 1e-4, 0.9, 0.999, 1e-8, 0.1


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=64 * 1024 * 1024, help="parameters per step (default 64M)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per variant (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    if not native.available():
        print(f"cpu_adam: native kernel not available: {native.load_error()}", file=sys.stderr)
        return 1

    n = args.numel
    all_threads = len(os.sched_getaffinity(0))
    gen = torch.Generator().manual_seed(0)

    # native buffers
    master = torch.randn(n, generator=gen)
    m = torch.zeros(n)
    v = torch.zeros(n)
    grad_bf16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    copy_bf16 = torch.empty(n, dtype=torch.bfloat16)
    # torch fused buffers (its own master and state; shares the bf16 grad and the bf16 copy buffer)
    param = torch.nn.Parameter(master.clone())
    grad_f32 = torch.empty(n)
    param.grad = grad_f32
    opt = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, fused=True)
    # triad buffers
    ta, tb, tc = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    step = [0]

    def run_native():
        step[0] += 1
        native.adamw_step_(
            master, m, v, grad_bf16, copy_bf16, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, step=step[0]
        )

    hyper = kernels.AdamHyper(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, decoupled=True)
    scratch = torch.empty(3, kernels.PEEK_CHUNK)

    def run_peek():
        native.adamw_peek_(
            master,
            m,
            v,
            grad_bf16,
            copy_bf16,
            lr=LR,
            beta1=BETA1,
            beta2=BETA2,
            eps=EPS,
            weight_decay=WD,
            step=step[0] + 1,
        )

    def run_peek_in_copies():
        kernels.peek_in_scratch(master, m, v, grad_bf16, copy_bf16, hyper, step[0] + 1, scratch)

    def run_torch_fused():
        grad_f32.copy_(grad_bf16)
        opt.step()
        copy_bf16.copy_(param.detach())

    def run_triad():
        torch.add(tb, tc, alpha=0.5, out=ta)

    def run_triad_inplace():
        ta.add_(tc, alpha=1e-3)

    variants = [
        ("torch fused", run_torch_fused, BYTES_TORCH_FUSED),
        ("native", run_native, BYTES_NATIVE),
        ("native peek", run_peek, BYTES_PEEK),
        ("peek (copies)", run_peek_in_copies, BYTES_PEEK_COPIES),
        ("triad", run_triad, BYTES_TRIAD),
        ("triad (in place)", run_triad_inplace, BYTES_TRIAD),
    ]

    print(f"# CPU AdamW step, {n:,} params ({n * 4 / 2**30:.2f} GiB per fp32 array)")
    print(
        f"# {cpu_model()}, {all_threads} CPUs; torch {torch.__version__} "
        f"(capability {torch.backends.cpu.get_cpu_capability()}); kernel {native.backend()}"
    )
    header = f"| {'variant':<16} | {'threads':>7} | {'median ms':>9} | {'best ms':>8} | {'Gparams/s':>9} | {'B/param':>7} | {'GB/s':>6} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")

    results = {}
    thread_counts = [1] if all_threads == 1 else [1, all_threads]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        native.set_num_threads(threads)
        for _, fn, _ in variants:
            for _ in range(args.warmup):
                fn()
        times = {name: [] for name, _, _ in variants}
        for _ in range(args.reps):
            for name, fn, _ in variants:
                times[name].append(timed(fn))
        for name, _, nbytes in variants:
            med, best = statistics.median(times[name]), min(times[name])
            results[(name, threads)] = med
            print(
                f"| {name:<16} | {threads:>7} | {med * 1e3:>9.1f} | {best * 1e3:>8.1f} | "
                f"{n / med / 1e9:>9.3f} | {nbytes:>7} | {n * nbytes / med / 1e9:>6.2f} |"
            )

    for threads in thread_counts:
        t_nat, t_torch = results[("native", threads)], results[("torch fused", threads)]
        t_triad = min(results[("triad", threads)], results[("triad (in place)", threads)])
        speedup = t_torch / t_nat
        of_ceiling = (BYTES_NATIVE / t_nat) / (BYTES_TRIAD / t_triad)
        print(
            f"# threads={threads}: native is {speedup:.2f}x torch fused end to end, "
            f"at {of_ceiling * 100:.0f}% of the triad bandwidth ceiling ({n * BYTES_TRIAD / t_triad / 1e9:.1f} GB/s)"
        )
    print(f"cpu_adam: native/torch_fused={speedup:.2f} native/ceiling={of_ceiling:.2f} threads={threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
