"""The schedule model of strategy="megatrain" on a modelled GPU: the steady-state step, its bound and MFU.

    python bench/schedule.py --model llama-3.1-8b --tokens 32768 [--micro-batches K] [--clip 1.0]
        [--device h100-sxm] [--num-slots auto] [--recompute auto|true|false] [--png PLOT]

Runs 3 optimizer steps of Engine + this project's LlamaForCausalLM (bf16-mixed; each step K
micro-batches of 1 x --tokens, accumulated as Trainer(accumulate_grad_batches=K) does) on fake tensors,
records every decision the engine takes (megatrain_lightning/schedule), replays them on the device profile
and prints, for the last step (measured from the same point of the step before), each lane's busy time
and share of the step, then as the last line:

    schedule: model=<m> tokens_per_step=<n> clip=<c> step_s=<x> bound_s=<y> ratio=<x/y>
              bound=<gpu|h2d|d2h|host|step-chain> mfu=<z>      (one line)

bound_s is the busiest resource's work per step (gpu, h2d, d2h, host worker), or the optimizer step's chain
when it is longer (step-chain: no Adam step before its gradient is complete, with clipping before the
whole backward; no more than the next step's first forward before every Adam step; so the host's Adam
time + the GPU's work but the first forward, and without clipping but the last backward and with the last
accumulation: schedule/report.py); ratio = step_s / bound_s (1.0: the step at its bound); mfu = (6·N·tokens + causal
attention FLOPs, forward and backward, no recompute) / step_s / the profile's dense bf16 peak.

Token tiles and input offload are the planner's choices for the profile's GPU memory; ``--num-slots auto``
(the default, as the strategy's) lets the engine size its slots after the first step from the planner's
free and transient memory for that GPU. The recording is replayed live on the profile, so the engine's
decisions that depend on timing (prefetch a block whose step is done) are the ones it would take on that
device.

Data parallel, modelled for a mode the strategy does not run yet (megatrain_lightning/schedule/ranks.py):
``--gpus N [--link nvlink|pcie]`` models one rank of N GPUs of one node (--micro-batches is then per GPU);
``--scaling 1,2,4,8`` prints strong scaling (the step's --micro-batches split over N GPUs) and weak scaling
(``--weak-micro-batches`` per GPU, default 1) as a Markdown table (schedule/scaling.py):

    python bench/schedule.py --model llama-3.1-8b --tokens 4096 --micro-batches 8 --scaling 1,2,4,8

``megatrain schedule`` (--seq-len for --tokens) prints the same through the same function,
``megatrain_lightning.schedule.modelled_step``; this script adds ``--png``, ``--measure-host``,
``--host-adam-gparams``, ``--layers`` and ``--launch-us``. ``--measure-host`` times the host Adam kernel here instead of the profile's 28 B/param over host
bandwidth; ``--host-adam-gparams`` gives the rate. ``--png`` draws the lanes of the last two steps (needs
matplotlib: ``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is a folder of scripts

from timeline import draw_lanes  # noqa: E402

from megatrain_lightning.cli.commands import add_data_parallel, add_host_rates, add_recompute, int_or_auto
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import (
    PROFILES,
    DataParallel,
    Profile,
    measure_host_adam,
    modelled_step,
    profile,
    scaling,
    scaling_table,
)
from megatrain_lightning.schedule.modelled import check_options
from megatrain_lightning.schedule.replay import LAUNCH_S, Interval, Timeline
from megatrain_lightning.schedule.report import Summary, steady_window

PNG_LANES = ("compute", "h2d", "d2h", "host", "issue", "issue blocked")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="llama-3.1-8b", help="a preset of megatrain_lightning.models (default llama-3.1-8b)"
    )
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch: 1 x this sequence length")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step, as Trainer(accumulate_grad_batches) (default 1)",
    )
    ap.add_argument(
        "--clip", type=float, default=None, help="global-norm gradient clipping, as Trainer(gradient_clip_val)"
    )
    ap.add_argument("--device", default="h100-sxm", choices=sorted(PROFILES), help="device profile (default h100-sxm)")
    ap.add_argument("--png", type=Path, default=None, help="draw the lanes of the last two steps into this PNG")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps recorded (the last is measured; at least 2)")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the preset's)")
    ap.add_argument(
        "--num-slots",
        type=int_or_auto("a number of slots"),
        default="auto",
        help="device weight slots, or auto (the default, as the strategy's: the engine grows them after "
        "the first step from the planner's free and transient GPU memory for the profile)",
    )
    ap.add_argument("--launch-us", type=float, default=LAUNCH_S * 1e6, help="issue cost of one kernel or copy, us")
    host = ap.add_mutually_exclusive_group()
    host.add_argument("--measure-host", action="store_true", help="time kernels.adam_step_ on this machine")
    host.add_argument("--host-adam-gparams", type=float, default=None, help="host Adam rate, 10^9 params/s")
    add_recompute(ap)
    add_data_parallel(ap)
    add_host_rates(ap, adam=False)  # (the Adam rate: the group above)
    ap.add_argument(
        "--scaling",
        type=_counts,
        default=None,
        metavar="1,2,4,8",
        help="print strong and weak scaling over these GPU counts (the first 1) instead of one step",
    )
    ap.add_argument(
        "--weak-micro-batches", type=int, default=1, help="micro-batches per GPU of --scaling's weak rows (default 1)"
    )
    args = ap.parse_args(argv)
    try:
        check_options(args.tokens, args.micro_batches, args.clip, args.num_slots, args.steps)
        check_options(args.tokens, args.weak_micro_batches, args.clip, args.num_slots, args.steps)
        DataParallel(args.gpus, args.link).rank_profile(profile(args.device))
    except ValueError as err:
        ap.error(str(err))
    return args


def _counts(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of GPU counts, e.g. 1,2,4,8"
        ) from None


def device_profile(args: argparse.Namespace) -> tuple[Profile, str | None]:
    """The profile asked for, with the host Adam rate measured or given; and where that rate comes from."""
    try:
        base = profile(args.device).with_host(args.host_gbps)
    except ValueError as err:
        raise SystemExit(f"bench/schedule.py: {err}") from None
    if args.measure_host:
        return base.with_host_adam(measure_host_adam()), "measured on this machine"
    if args.host_adam_gparams is not None:
        return base.with_host_adam(args.host_adam_gparams), "given"
    return base, None


def config_of(args: argparse.Namespace) -> LlamaConfig:
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    return LlamaConfig.from_preset(args.model, **overrides)


def plot(timeline: Timeline, s: Summary, steps: int, path: Path, title: str) -> str:
    """The lanes over the last two steps; returns what was written, or why nothing was."""
    lo, hi = _two_steps(timeline, s, steps)
    rows = [
        (
            lane,
            [(max(iv.start, lo) - lo, min(iv.end, hi) - max(iv.start, lo)) for iv in _merged(timeline, lane, lo, hi)],
            "0.6" if "blocked" in lane else f"C{PNG_LANES.index(lane)}",
        )
        for lane in PNG_LANES
    ]
    return draw_lanes(
        rows, path, title, "seconds (dashed: the measured step)", size=(14, 3.6), marks=tuple(x - lo for x in s.window)
    )


def _two_steps(timeline: Timeline, s: Summary, steps: int) -> tuple[float, float]:
    """From the end of the backward of the step before the last two (or the start) to the measured end."""
    return (steady_window(timeline, steps - 1)[0] if steps >= 3 else 0.0), s.window[1]


def _merged(timeline: Timeline, lane: str, lo: float, hi: float) -> list[Interval]:
    """The lane's intervals inside [lo, hi], touching ones merged (thousands of kernels draw as few bars)."""
    out: list[Interval] = []
    for iv in sorted(
        (iv for iv in timeline.intervals if iv.lane == lane and iv.end > lo and iv.start < hi), key=lambda iv: iv.start
    ):
        if out and iv.start <= out[-1].end + 1e-9:
            out[-1] = dataclasses.replace(out[-1], end=max(out[-1].end, iv.end))
        else:
            out.append(iv)
    return out


def print_scaling(args: argparse.Namespace, prof: Profile) -> int:
    """The strong and weak scaling table, after what was modelled."""
    try:
        rows = scaling(
            config_of(args),
            prof,
            args.tokens,
            args.micro_batches,
            args.weak_micro_batches,
            args.scaling,
            args.link,
            args.clip,
            args.steps,
            args.model,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            recompute=args.recompute,
        )
    except ValueError as err:
        print(f"schedule.py: error: {err}", file=sys.stderr)
        return 2
    one = rows[0].step.describe()
    print(f"{one[0]}\n{one[2]} (one GPU; a rank of N: 1/N of the host's bandwidth and Adam rate)")
    print(scaling_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    prof, adam = device_profile(args)
    if args.scaling is not None:
        return print_scaling(args, prof)
    step = modelled_step(
        config_of(args),
        prof,
        args.tokens,
        args.micro_batches,
        args.clip,
        args.num_slots,
        args.steps,
        args.launch_us * 1e-6,
        name=args.model,
        adam_source=adam,
        gpus=args.gpus,
        link=args.link,
        recompute=args.recompute,
    )
    *lines, last = step.report()
    print("\n".join(lines))
    if args.png is not None:
        print(plot(step.timeline, step.summary, args.steps, args.png, last.removeprefix("schedule: ")))
    print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
