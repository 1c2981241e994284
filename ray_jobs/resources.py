"""What one trial asks Ray for, sized by the memory planner, and the check that some node can give it."""

from __future__ import annotations

from typing import Any

from megatrain_lightning.module import resolve_config
from megatrain_lightning.planner import format_size, parse_size, plan
from ray_jobs.config import SweepConfig, apply


class SweepRefused(RuntimeError):
    """No node of the cluster can run a trial of this sweep; nothing was started."""


def trial_resources(cfg: SweepConfig, params: dict[str, Any] | None = None) -> dict[str, float]:
    """{"GPU": 1, "CPU": n, "memory": bytes[, node_resource: 1]} for the base config with `params` applied.

    Host memory is the planner's figure for that model, sequence length, micro-batch and precision plus
    the configured headroom; it is what lets Ray place trials only on nodes with enough memory.
    """
    run = apply(cfg.base, params or {})
    model, data, trainer = run.get("model", {}), run.get("data", {}), run.get("trainer", {})
    config = resolve_config(model.get("model") or model.get("init_from") or "tiny", model.get("overrides"))
    p = plan(
        config,
        seq_len=int(data.get("seq_len", 2048)),
        micro_batch=int(data.get("batch_size", 1)),
        precision=str(trainer.get("precision", "bf16-mixed")),
        accumulate=int(trainer.get("accumulate_grad_batches", 1)),
    )
    res = cfg.resources
    out = {"GPU": float(res.gpus_per_trial), "CPU": float(res.cpus_per_trial),
           "memory": float(p.host_total + parse_size(res.memory_headroom))}  # fmt: skip
    if res.node_resource:
        out[res.node_resource] = 1.0
    return out


def check_fits(request: dict[str, float], nodes: list[dict[str, Any]]) -> None:
    """Raise :class:`SweepRefused`, naming every node's size, when no alive node covers `request`."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    for node in alive:
        have = node.get("Resources", {})
        if all(have.get(k, 0.0) >= v for k, v in request.items()):
            return
    sizes = "; ".join(f"{n.get('NodeManagerAddress', '?')}: {_describe(n.get('Resources', {}))}" for n in alive) or "none alive"
    raise SweepRefused(
        f"a trial needs {_describe(request)}, which no node of the cluster offers (nodes: {sizes}). "
        "Use nodes with more host memory (ray start --memory / bigger machines), a smaller model, batch or "
        "sequence, or declare the custom node resource on the big-memory nodes."
    )


def _describe(resources: dict[str, float]) -> str:
    parts = []
    for key in sorted(resources):
        if key.startswith("node:") or key in ("object_store_memory",) or key.startswith("accelerator_type"):
            continue
        value = resources[key]
        parts.append(f"{key} {format_size(value)}" if key == "memory" else f"{key} {value:g}")
    return ", ".join(parts)
