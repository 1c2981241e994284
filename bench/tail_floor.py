"""How close a step of several micro-batches can come to its GPU lane while the optimizer state is in host memory.

    python bench/tail_floor.py [--model llama-3.1-8b] [--device h100-sxm] [--seq-len 4096] [--micro-batches 4]
        [--keep-attention] [--host-gbps G]

Records the step as ``megatrain schedule`` does with every unit's gradient summed on the device, a slot for
every block and speculative steps (the best the engine finds for such steps), then prints, for the tail
between the last backward and the next forward, the least GPU idle each resource allows in any order of its
work (megatrain_lightning/schedule/floor.py: the link down with the fp32 sums, the host with the speculative
steps, the link up with the new weights), the floor step that follows (GPU lane + least idle) against the
recorded step, and the same floor with the embedding and head taken as stepped on the GPU (their master
weights and moments held there: the GPU memory that needs is printed).
"""

from __future__ import annotations

import argparse

from megatrain_lightning.cli.commands import resolve_config
from megatrain_lightning.planning import planner
from megatrain_lightning.schedule import modelled_step, profile
from megatrain_lightning.schedule.floor import RESOURCES, floor_idle, least_idle, tail_units

GiB = 2**30
MASTER_AND_MOMENTS = 12  # bytes per parameter held on the GPU by a unit stepped there (fp32 master, m, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--keep-attention", action="store_true")
    ap.add_argument("--host-gbps", type=float, help="host memory bandwidth, GB/s (default: the profile's)")
    args = ap.parse_args()
    config = resolve_config(args.model)
    device = profile(args.device).with_host(args.host_gbps, None)
    blocks = config.num_hidden_layers
    step = modelled_step(
        config,
        device,
        args.seq_len,
        args.micro_batches,
        clip=1.0,
        num_slots=blocks,
        steps=2,
        name=args.model,
        grad_sums=blocks,
        speculative_step=True,
        keep_attention=args.keep_attention,
    )
    s = step.summary
    lane = s.busy["gpu"]
    print("\n".join(step.describe()))
    print(
        f"recorded: step {s.step_s:.3f} s, GPU lane {lane:.3f} s ({s.step_s / lane:.3f} x), GPU idle {s.gpu_idle_s:.3f} s"
    )
    print()
    print(
        "| optimizer state | least idle: " + " / ".join(RESOURCES) + " | floor step | floor / lane | GPU memory more |"
    )
    print("|---|---|---|---|---|")
    outer = planner.outer_numel(config)  # the embedding, final norm and head: floor.py's two outer units
    for label, on_device, extra in (
        ("in host memory (the engine)", (), 0),
        ("embedding and head on the GPU", ("embedding", "head"), outer * MASTER_AND_MOMENTS),
    ):
        units = tail_units(
            step.timeline, step.steps, config, device.link_bytes(), device.host_bytes(), on_device=on_device
        )
        idle = {r: least_idle(units, r) for r in RESOURCES}
        x, _ = floor_idle(units)
        ms = " / ".join(f"{idle[r] * 1e3:.0f}" for r in RESOURCES)
        print(f"| {label} | {ms} ms | {lane + x:.3f} s | {(lane + x) / lane:.3f} | {extra / GiB:.1f} GiB |")
    print()
    links = link_floor(step, config, device)
    print(
        f"the links alone (host infinitely fast): least idle {links * 1e3:.0f} ms, floor {(lane + links) / lane:.3f} x "
        "the lane"
    )
    for target in (1.05, 1.10):
        need = host_needed(step, config, device, lane * (target - 1))
        print(
            f"host bandwidth the floor needs for {target:g} x the lane: "
            + (f"{need:.0f} GB/s" if need is not None else "none is enough (the links' floor is above it)")
            + f" (the profile's: {device.host_bytes() / 1e9:.0f} GB/s)"
        )


def host_needed(step, config, device, idle: float) -> float | None:
    """The least host bandwidth (GB/s, by bisection) at which the tail's floor is at most `idle`; None where the
    links' own floor is above it."""
    if link_floor(step, config, device) > idle:
        return None
    lo, hi = 1e-3 * device.host_bytes(), 1e3 * device.host_bytes()
    for _ in range(40):
        mid = (lo + hi) / 2
        units = tail_units(step.timeline, step.steps, config, device.link_bytes(), mid)
        lo, hi = (lo, mid) if floor_idle(units)[0] <= idle else (mid, hi)
    return hi / 1e9


def link_floor(step, config, device) -> float:
    """The least idle the links alone allow (the host taken as infinitely fast)."""
    units = tail_units(step.timeline, step.steps, config, device.link_bytes(), device.host_bytes())
    return max(least_idle(units, r) for r in ("d2h", "h2d"))


if __name__ == "__main__":
    main()
