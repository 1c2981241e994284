"""What offload_inputs_dtype costs in quality: the demo trained with offloaded block inputs stored exactly,
as bf16 and as fp8, the same seeds, each to the end; its final validation loss and perplexity.

    python bench/offload_inputs_dtype.py [--seeds 0 1 2] [--max-steps 300] [--dtypes none bf16 fp8]
                                         [--accelerator auto|gpu|cpu] [--val-batches N]

Each run is ``megatrain fit --config configs/demo.yaml`` in its own process, in fp32 (``32-true``, where
all three stored forms apply) with ``offload_inputs: true`` forced, so every block's input makes the round
trip through host memory; only ``offload_inputs_dtype`` and the seed change. ``--max-steps`` shortens all
runs alike (the learning-rate schedule follows it). Run from the repository root. Results and how to read
them: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STORED_BYTES = {"none": "4", "bf16": "2", "fp8": "1 + 4/hidden"}  # per element of an fp32 block input


def run(
    dtype: str, seed: int, max_steps: int, root: Path, accelerator: str = "auto", val_batches: int | None = None
) -> tuple[float, float]:
    """One training run: (final validation loss, wall seconds). `val_batches`: validate on that many batches
    only, with no sanity pass before training (a smoke run; its loss is not the demo's)."""
    quick = (
        []
        if val_batches is None
        else ["--trainer.num_sanity_val_steps=0", f"--trainer.limit_val_batches={val_batches}"]
    )
    out = root / f"{dtype}-{seed}"
    strategy = "--trainer.strategy.init_args."
    cmd = [
        sys.executable,
        "-m",
        "megatrain_lightning",
        "fit",
        "--config",
        "configs/demo.yaml",
        f"--seed_everything={seed}",
        f"--trainer.max_steps={max_steps}",
        f"--trainer.accelerator={accelerator}",
        f"--trainer.val_check_interval={min(100, max_steps)}",  # a run shorter than 100 steps validates too
        "--trainer.precision=32-true",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.strategy=megatrain_lightning.MegatrainStrategy",
        f"{strategy}offload_inputs=true",
        *quick,
        *([] if dtype == "none" else [f"{strategy}offload_inputs_dtype={dtype}"]),
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:  # the run's own words, not only its exit status
        tail = "\n".join(done.stderr.splitlines()[-40:])
        sys.exit(f"{' '.join(cmd)}\nexited with {done.returncode}; the end of its stderr:\n{tail}")
    seconds = time.perf_counter() - t0
    (metrics,) = out.glob("lightning_logs/version_*/metrics.csv")
    with metrics.open() as f:
        losses = [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r.get("val_loss")]
    return max(losses)[1], seconds  # the last validation: the end of training


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-steps", type=int, default=300, help="the demo's own: 300")
    ap.add_argument("--dtypes", nargs="+", default=["none", "bf16", "fp8"], choices=list(STORED_BYTES))
    ap.add_argument("--accelerator", default="auto", help="Trainer(accelerator=): auto (default), gpu or cpu")
    ap.add_argument(
        "--val-batches",
        type=int,
        help="validate on this many batches, without the sanity pass (a quick check; default: the demo's whole "
        "validation set)",
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="offload_dtype_"))
    results: dict[str, list[float]] = {d: [] for d in args.dtypes}
    print("| offload_inputs_dtype | seed | val loss | perplexity | wall s |\n|---|---|---|---|---|", flush=True)
    for seed in args.seeds:  # seeds outermost: a run cut short still leaves whole comparisons
        for dtype in args.dtypes:
            loss, seconds = run(dtype, seed, args.max_steps, root, args.accelerator, args.val_batches)
            results[dtype].append(loss)
            print(f"| {dtype} | {seed} | {loss:.4f} | {math.exp(loss):.3f} | {seconds:.0f} |", flush=True)
    base = results.get("none")
    print(
        "\n| offload_inputs_dtype | bytes/element | mean val loss | mean perplexity | loss - none, per seed "
        "| mean difference (std. error) |\n|---|---|---|---|---|---|"
    )
    for dtype, losses in results.items():
        mean = statistics.fmean(losses)
        print(f"| {dtype} | {STORED_BYTES[dtype]} | {mean:.4f} | {math.exp(mean):.3f} | {paired(losses, base)}")
    if base is not None and len(base) > 1:
        print(f"\nseed-to-seed spread of none (stdev of val loss): {statistics.stdev(base):.4f}")
    print(f"\n{os.cpu_count()} CPUs; runs in {root}")


def paired(losses: list[float], base: list[float] | None) -> str:
    """The same-seed differences from the exact runs, their mean and its standard error (two table cells)."""
    if base is None:
        return " | |"
    deltas = [a - b for a, b in zip(losses, base)]
    spread = f" ({statistics.stdev(deltas) / math.sqrt(len(deltas)):.3f})" if len(deltas) > 1 else ""
    return f"{' '.join(f'{d:+.3f}' for d in deltas)} | {statistics.fmean(deltas):+.3f}{spread} |"


if __name__ == "__main__":
    main()
