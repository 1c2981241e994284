"""Pictures where a reader would rather look than read: a run's loss curves (the demo's ``loss.png``) and
a plan's host and GPU memory breakdown (``megatrain plan --png``).

matplotlib is an optional extra (``pip install 'megatrain_lightning[plot]'``); without it every function
here raises one ImportError line saying so. Figures are drawn through matplotlib's object API on the Agg
canvas, so drawing neither needs a display nor changes the pyplot backend of the caller's session.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatrain_lightning.planning.planner import Plan

MISSING = "drawing needs matplotlib, which is not installed: pip install 'megatrain_lightning[plot]'"


def require() -> None:
    """Raise ImportError, one line saying how to install it, when matplotlib is missing (commands call
    this before their work, so that a missing extra costs no time)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None


def figure(width: float, height: float) -> Any:
    """A matplotlib Figure with an Agg canvas attached (``fig.savefig`` writes PNG)."""
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# -- loss curves ------------------------------------------------------------------------------------
def read_series(metrics_csv: str | os.PathLike, *names: str) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each named column of a Lightning ``CSVLogger`` metrics.csv, rows where it is empty
    skipped (each row holds what one ``log_metrics`` call logged)."""
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    with open(metrics_csv, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for name in names:
                if row.get(name) not in (None, ""):
                    series[name].append((int(row["step"]), float(row[name])))
    return series


def loss_png(metrics_csv: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Draw ``train_loss`` and ``val_loss`` of `metrics_csv` against the step into the PNG file `out`."""
    series = read_series(metrics_csv, "train_loss", "val_loss")
    if not any(series.values()):
        raise ValueError(f"{metrics_csv} holds no train_loss or val_loss values to draw")
    fig = figure(7, 4)
    ax = fig.add_subplot()
    for name, style in (("train_loss", "-"), ("val_loss", "o-")):
        if series[name]:
            steps, values = zip(*series[name])
            ax.plot(steps, values, style, label=name.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


# -- the planner's memory breakdown ---------------------------------------------------------------
def plan_png(plan: Plan, out: str | os.PathLike) -> Path:
    """Draw `plan`'s host memory (every buffer) and GPU peak (what it holds) as two stacked bars, each
    against its limit when the plan was checked against one, into the PNG file `out`."""
    fig = figure(10, 5.5)
    host_ax, gpu_ax = fig.subplots(2, 1)
    _stacked_bar(host_ax, "host memory" + plan.when_data_parallel(" per node"), plan.host_items(), plan.host_mem)
    _stacked_bar(gpu_ax, "GPU memory at the peak", plan.gpu_peak_items(), plan.gpu_mem)
    fig.suptitle(f"{plan.name}: seq_len {plan.seq_len} x micro-batch {plan.micro_batch}, {plan.precision}")
    return _save(fig, out)


def _stacked_bar(ax: Any, title: str, items: list[tuple[str, int]], limit: int | None) -> None:
    items = [(label, value) for label, value in items if value > 0]
    total = sum(value for _, value in items)
    unit, scale = _unit(max(total, limit or 0))
    left = 0.0
    for label, value in items:
        ax.barh(0, value / scale, left=left, label=f"{label}: {value / scale:.2f} {unit}")
        left += value / scale
    if limit is not None:
        ax.axvline(limit / scale, color="black", linestyle="--", label=f"limit: {limit / scale:.2f} {unit}")
    ax.set_title(f"{title}: {total / scale:.2f} {unit}")
    ax.set_xlabel(unit)
    ax.set_yticks([])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def _unit(nbytes: float) -> tuple[str, int]:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return unit, scale
    return "KiB", 2**10


def _save(fig: Any, out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
