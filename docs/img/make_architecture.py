"""Draw docs/img/architecture.png: the engine's host side and its streams (top), and one optimizer step of
those streams as the engine schedules it (bottom).

    python docs/img/make_architecture.py [OUT.png]     # needs matplotlib: pip install -e ".[plot]"

The bottom half is not drawn by hand: :func:`megatrain_lightning.schedule.modelled_step` runs the engine on
fake tensors for a Llama-3.1-8B cut to 4 blocks (full width, 4096 tokens, bf16-mixed, 2 weight slots, every
block recomputed, no clipping), records every upload, download, kernel and host job it issues, and replays
them on the H100 profile. So the picture follows the engine: rerun this script after changing the order of
uploads, downloads or host jobs, and commit the PNG (a few minutes on two CPU cores). The top half names the
buffers of docs/architecture.md ("Where every byte lives") with their bytes per parameter from the planner.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from megatrain_lightning.lightning import plots
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import modelled_step, profile
from megatrain_lightning.schedule.replay import Interval

OUT = Path(__file__).resolve().parent / "architecture.png"
LANES = (("compute", "compute stream"), ("h2d", "H2D stream"), ("d2h", "D2H stream"), ("host", "host worker"))
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else OUT
    plots.require()
    step = modelled_step(
        LlamaConfig.from_preset("llama-3.1-8b", num_hidden_layers=4),
        profile("h100-sxm"),
        seq_len=4096,
        num_slots=2,
        recompute=True,
        name="llama-3.1-8b, 4 blocks",
    )
    fig = plots.figure(13, 9.5)
    top, bottom = fig.subplots(2, 1, height_ratios=[1.25, 1])
    draw_layout(top)
    draw_step(bottom, step.timeline.intervals, step.summary.window)
    fig.savefig(out, format="png", dpi=100)
    print(f"wrote {out}")
    return 0


# -- top: where the bytes live and which stream moves them -------------------------------------------
def box(ax, x: float, y: float, w: float, h: float, text: str, color: str, size: float = 9) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="0.3", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], text: str, color: str, rad: float = 0.0) -> None:
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops=dict(arrowstyle="-|>", color=color, lw=2, connectionstyle=f"arc3,rad={rad}"),
    )
    if text:
        mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(*mid, text, ha="center", va="center", fontsize=8.5, color=color, bbox=dict(fc="w", ec="none", pad=1))


def draw_layout(ax) -> None:
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5)
    ax.axis("off")
    ax.set_title("where every byte lives, and which stream moves it", fontsize=11)
    # Host memory: one flat buffer of each kind per unit (a block, or a parameter outside the blocks).
    box(ax, 0.05, 0.1, 4.3, 4.75, "", "#f4f4f4")
    ax.text(2.2, 4.6, "host memory: flat buffers per unit (a block)", ha="center", fontsize=10, weight="bold")
    rows = [
        ("fp32 master weights: 4 B/param", "#e8e8f8"),
        ("Adam m, v (fp32): 8 B/param", "#e8e8f8"),
        ("pinned compute copy (bf16): 2 B/param", "#d8ecd8"),
        ("pinned gradient slab (bf16): 2 B/param", "#f8e4d4"),
    ]
    for i, (text, color) in enumerate(rows):
        box(ax, 0.9, 3.85 - 0.62 * i, 3.25, 0.45, text, color)
    box(
        ax,
        0.9,
        0.3,
        3.25,
        1.1,
        "host worker thread (engine/host/worker.py)\nwaits for a gradient's copy event, then per unit:\n"
        "land (or accumulate) -> AdamW step -> rewrite the copy",
        "#fff4c8",
        8.5,
    )
    arrow(ax, (2.5, 1.99), (2.5, 1.45), "", "#dd8452")  # slab -> worker
    arrow(ax, (0.9, 0.95), (0.9, 2.77), "", "#55a868", rad=-0.5)  # worker -> copy (and master, m, v)
    ax.text(
        0.5,
        1.85,
        "stepped\nweights",
        ha="center",
        va="center",
        fontsize=8,
        color="#55a868",
        bbox=dict(fc="#f4f4f4", ec="none", pad=1),
    )
    # GPU memory: slots the blocks stream through; nothing here grows with depth but the saved inputs.
    box(ax, 5.55, 0.1, 4.4, 4.75, "", "#f4f4f4")
    ax.text(7.75, 4.6, "GPU memory (does not grow with depth)", ha="center", fontsize=10, weight="bold")
    box(ax, 5.8, 3.75, 1.9, 0.55, "weight slot A\nblock i, computing", "#d8ecd8", 8.5)
    box(ax, 7.85, 3.75, 1.9, 0.55, "weight slot B\nblock i+1, arriving", "#d8ecd8", 8.5)
    box(ax, 5.8, 2.85, 3.95, 0.5, "2 gradient slots: a block's gradients leaving", "#f8e4d4", 8.5)
    box(ax, 5.8, 2.05, 3.95, 0.5, "embedding, final norm, head: device copies", "#e8e8f8", 8.5)
    box(ax, 5.8, 1.25, 3.95, 0.5, "block inputs saved for backward (or pinned host)", "#e8e8f8", 8.5)
    box(
        ax,
        5.8,
        0.3,
        3.95,
        0.65,
        "compute stream: forward, then per block backward:\nrecompute from the saved input, gradients",
        "#dce6f4",
        8.5,
    )
    arrow(ax, (4.2, 3.02), (5.75, 3.95), "H2D stream:\nupload into a free slot", "#4c72b0")
    arrow(ax, (5.75, 3.0), (4.2, 2.4), "D2H stream:\ngradients down", "#dd8452")


# -- bottom: one step of the streams, as the engine issues them ----------------------------------------
def draw_step(ax, intervals: list[Interval], window: tuple[float, float]) -> None:
    lo, hi = window
    for row, (lane, _) in enumerate(reversed(LANES)):
        for iv in merged([iv for iv in intervals if iv.lane == lane and iv.end > lo and iv.start < hi], lo, hi):
            start, end = max(iv.start, lo), min(iv.end, hi)
            kind = iv.phase.split(" ")[0] if iv.phase else ""
            ax.broken_barh([((start - lo) * 1e3, (end - start) * 1e3)], (row - 0.38, 0.76), color=color(kind))
            label = block_of(iv.phase)
            if label is not None and (end - start) / (hi - lo) > 0.012:
                ax.text((start + end - 2 * lo) / 2 * 1e3, row, label, ha="center", va="center", fontsize=7, color="w")
    ax.set_yticks(range(len(LANES)), [name for _, name in reversed(LANES)])
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("milliseconds of one optimizer step (numbers: the block a copy or host job is for)")
    ax.set_title(
        "one step as the engine schedules it (schedule model: Llama-3.1-8B width, 4 blocks, 4096 tokens, H100)",
        fontsize=10,
    )
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in PHASE_COLORS.items()]
    ax.legend(handles=handles, loc="upper left", fontsize=8, ncols=3, title="issued in the", title_fontsize=8)


def merged(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    """Touching intervals of one phase joined (a block's hundreds of kernels draw as one bar)."""
    out: list[Interval] = []
    for iv in sorted(intervals, key=lambda iv: iv.start):
        if out and out[-1].phase == iv.phase and iv.start <= out[-1].end + 1e-6:
            last = out[-1]
            out[-1] = Interval(last.lane, last.start, max(last.end, iv.end), last.step, last.what, last.phase)
        else:
            out.append(iv)
    return out


def block_of(phase: str) -> str | None:
    found = re.search(r"block (\d+)$", phase)
    return found.group(1) if found else None


def color(kind: str) -> str:
    return PHASE_COLORS.get(kind, "0.55")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
