"""Scaling of the data-parallel mode over the GPUs of one node, from the schedule model.

Each row is :func:`~megatrain_lightning.schedule.modelled.modelled_step` of one rank (``ranks.py``):

- strong scaling keeps the step's global tokens: `global_micro_batches` sequences of `seq_len` per step,
  global_micro_batches / N of them on each of N GPUs (so N must divide it);
- weak scaling keeps each GPU's tokens: `per_gpu_micro_batches` sequences on every GPU, N times the tokens
  per step in all.

Speedup is tokens per second against the same mode's one-GPU row; efficiency is speedup / N. A weak-scaling
speedup spreads the step's fixed costs (the host's Adam over every parameter, on one node's DRAM whatever N
is) over N times the tokens, so it is not comparable with a strong-scaling one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule.modelled import ModelledStep, modelled_step
from megatrain_lightning.schedule.profiles import Profile

MODES = ("strong", "weak")


@dataclass(frozen=True)
class ScalingRow:
    mode: str  # "strong" | "weak"
    gpus: int
    step: ModelledStep
    speedup: float  # tokens/s against the mode's one-GPU row

    @property
    def efficiency(self) -> float:
        return self.speedup / self.gpus


def scaling(
    config: LlamaConfig,
    profile: Profile,
    seq_len: int,
    global_micro_batches: int,
    per_gpu_micro_batches: int = 1,
    gpus: Sequence[int] = (1, 2, 4, 8),
    link: str = "nvlink",
    clip: float | None = None,
    steps: int = 3,
    name: str = "model",
    progress: Callable[[str], None] | None = None,
    modes: Sequence[str] = MODES,
    recompute: bool | str = "auto",
) -> list[ScalingRow]:
    """Strong and weak scaling rows over `gpus` (which starts at 1); each distinct (micro-batches, GPUs)
    is modelled once (the strong row at global_micro_batches / N = per_gpu_micro_batches is the weak one);
    `modes`: the rows wanted, "strong" and "weak"; `recompute`: the engine's option."""
    if not gpus or gpus[0] != 1:
        raise ValueError(f"gpus={list(gpus)!r} must start at 1: speedups are against one GPU")
    for n in gpus:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or global_micro_batches % n:
            raise ValueError(
                f"{n!r} GPUs: strong scaling splits {global_micro_batches} micro-batches per step evenly; give "
                "GPU counts that divide it"
            )
    done: dict[tuple[int, int], ModelledStep] = {}

    def step(micro_batches: int, n: int) -> ModelledStep:
        if (micro_batches, n) not in done:
            if progress is not None:
                progress(f"modelling {name}: {n} GPU(s), {micro_batches} micro-batch(es) of {seq_len} tokens each")
            done[micro_batches, n] = modelled_step(
                config,
                profile,
                seq_len,
                micro_batches,
                clip,
                steps=steps,
                name=name,
                gpus=n,
                link=link,
                recompute=recompute,
            )
        return done[micro_batches, n]

    rows = []
    for mode in modes:
        per_gpu = {n: global_micro_batches // n if mode == "strong" else per_gpu_micro_batches for n in gpus}
        base = step(per_gpu[1], 1).tokens_per_s
        for n in gpus:
            s = step(per_gpu[n], n)
            rows.append(ScalingRow(mode, n, s, s.tokens_per_s / base))
    return rows


def scaling_table(rows: list[ScalingRow]) -> str:
    """The rows as a Markdown table (what ``bench/schedule.py --scaling`` prints)."""
    out = [
        "| scaling | GPUs | tokens/GPU/step | tokens/step | step s | tokens/s | speedup | efficiency | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r.step
        out.append(
            f"| {r.mode} | {r.gpus} | {s.step_tokens} | {s.global_tokens} | {s.summary.step_s:.3f} | "
            f"{s.tokens_per_s:,.0f} | {r.speedup:.2f} | {r.efficiency:.0%} | {s.summary.bound} |"
        )
    return "\n".join(out)
