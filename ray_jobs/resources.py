"""What one trial asks Ray for, sized by the memory planner, and the check that some node can give it.

The host memory a trial asks for follows its strategy (the sweep file's `strategy` section): it is the
planner's host figure for that layout, which is the engine's own `host_bytes_per_param` (engine/host/units.py)
per parameter plus the lean layout's rings, and, with `nvme_dir`, the NVMe tier's few working buffers
(engine/host/nvme.py, as the planner counts them) in place of the 8 B/param Adam moments. No second formula
lives here. `host_layout: auto` is resolved here, once the driver knows the cluster: see
:func:`planned_tier`.
"""

from __future__ import annotations

from typing import Any

from megatrain_lightning.engine import EngineConfig
from megatrain_lightning.models.named import resolve_config
from megatrain_lightning.planning.planner import RunShape, choose_tiers, format_size, parse_size, plan
from ray_jobs.config import SweepConfig, TrainConfig, apply

Tier = tuple[str, bool]
"""(host layout, Adam on NVMe) of every trial, as the planner's :data:`~megatrain_lightning.planning.planner.TIERS`."""


class SweepRefused(RuntimeError):
    """No node of the cluster can run a trial of this sweep; nothing was started."""


def trial_resources(
    cfg: SweepConfig | TrainConfig, params: dict[str, Any] | None = None, tier: Tier | None = None
) -> dict[str, float]:
    """{"GPU": 1, "CPU": n, "memory": bytes[, node_resource: 1]} for the base config with `params` applied: what
    one trial asks for, or with `scaling` one of its workers (no "GPU" when ``use_gpu`` is false).

    Host memory is the planner's figure for that model, sequence length, micro-batch, precision,
    clipping and the trials' `tier` (default: :func:`planned_tier` without a cluster, so "auto" counts as
    "default") plus the configured headroom; it is what lets Ray place trials only on nodes with enough
    memory. A worker of a run of W holds 1/W of the host state (the data-parallel mode: the planner with W
    nodes of one device each) beside its own buffers; workers Ray puts on one node each ask for their own.
    """
    scaling = cfg.scaling
    layout, nvme = planned_tier(cfg) if tier is None else tier
    run = apply(cfg.base, params or {})
    model, data, trainer = run.get("model", {}), run.get("data", {}), run.get("trainer", {})
    config = resolve_config(model.get("model") or model.get("init_from") or "tiny", model.get("overrides"))
    shape = RunShape(
        config,
        seq_len=int(data.get("seq_len", 2048)),
        micro_batch=int(data.get("batch_size", 1)),
        accumulate=int(trainer.get("accumulate_grad_batches", 1)),
        nodes=scaling.num_workers if scaling is not None else 1,
    )
    options = EngineConfig(
        precision=str(trainer.get("precision", "bf16-mixed")),
        host_layout=layout,
        nvme_dir=cfg.strategy.nvme_dir if nvme else None,
        clipping=bool(trainer.get("gradient_clip_val")),  # the lean layout then keeps each gradient until the step
    )
    p = plan(shape, options)
    res = scaling if scaling is not None else cfg.resources
    gpus = (1.0 if scaling.use_gpu else 0.0) if scaling is not None else float(cfg.resources.gpus_per_trial)
    out = {
        "GPU": gpus,
        "CPU": float(scaling.cpus_per_worker if scaling is not None else cfg.resources.cpus_per_trial),
        "memory": float(p.host_total + parse_size(res.memory_headroom)),
    }
    if not gpus:
        del out["GPU"]
    if res.node_resource:
        out[res.node_resource] = 1.0
    return out


def planned_tier(cfg: SweepConfig | TrainConfig, nodes: list[dict[str, Any]] | None = None) -> Tier:
    """(host layout, Adam on NVMe) every trial runs with. A layout the sweep names is used as given (on NVMe
    when `nvme_dir` is set). "auto" is the planner's own choice (:func:`~megatrain_lightning.planning.planner.choose_tiers`)
    for the host memory of the largest alive node that offers everything else a trial asks for: the first of
    default, lean and (given `nvme_dir`) lean with Adam on NVMe whose memory request fits it. All trials share
    it, since they share one request; without `nodes`, or when no node qualifies, "auto" plans "default"
    (and :func:`check_fits` then names the nodes)."""
    st = cfg.strategy
    host_mem = None
    if st.host_layout == "auto" and nodes:
        others = {k: v for k, v in trial_resources(cfg, tier=("default", False)).items() if k != "memory"}
        sizes = [n.get("Resources", {}).get("memory", 0.0) for n in _alive(nodes) if _offers(n, others)]
        host_mem = int(max(sizes)) if sizes else None
    if st.host_layout == "auto" and host_mem is None:
        return "default", False

    def request(layout: str, nvme: bool) -> int:
        return int(trial_resources(cfg, tier=(layout, nvme))["memory"])

    return choose_tiers(request, st.host_layout, st.nvme_dir, host_mem)


def strategy_options(cfg: SweepConfig | TrainConfig, tier: Tier) -> dict[str, Any]:
    """Keyword arguments of each trial's ``MegatrainStrategy``: the `tier`'s layout, `nvme_dir` when the tier
    puts Adam on NVMe, and `host_threads` (unset: cpus_per_trial minus one, at least 1; a trial caps it at
    its node's cores). A worker of a run of several (`scaling`) gets `host_threads` only when the file sets
    it: unset, the engine takes the worker's share of its node's cores (split among the ranks Ray put there,
    which it sees, where the driver does not) minus one."""
    layout, nvme = tier
    if cfg.scaling is not None:
        threads = cfg.strategy.host_threads
    else:
        threads = cfg.strategy.host_threads or max(1, int(cfg.resources.cpus_per_trial) - 1)
    return {"host_layout": layout, "nvme_dir": cfg.strategy.nvme_dir if nvme else None, "host_threads": threads}


def check_fits(request: dict[str, float], nodes: list[dict[str, Any]]) -> None:
    """Raise :class:`SweepRefused`, naming every node's size, when no alive node covers `request`."""
    alive = _alive(nodes)
    if any(_offers(node, request) for node in alive):
        return
    sizes = (
        "; ".join(f"{n.get('NodeManagerAddress', '?')}: {_describe(n.get('Resources', {}))}" for n in alive)
        or "none alive"
    )
    raise SweepRefused(
        f"a trial needs {_describe(request)}, which no node of the cluster offers (nodes: {sizes}). "
        "Use nodes with more host memory (ray start --memory / bigger machines), a leaner strategy (host_layout: "
        "lean, or nvme_dir for the Adam moments), a smaller model, batch or sequence, or declare the custom node "
        "resource on the big-memory nodes."
    )


def check_workers_fit(request: dict[str, float], workers: int, nodes: list[dict[str, Any]]) -> None:
    """Raise :class:`SweepRefused`, naming every node's size, when the alive nodes together cannot hold `workers`
    workers of `request` each (a node holds as many as each of its resources covers)."""
    if workers == 1:
        return check_fits(request, nodes)
    alive = _alive(nodes)
    fit = [_how_many(n, request) for n in alive]
    if sum(fit) >= workers:
        return None
    sizes = "; ".join(
        f"{n.get('NodeManagerAddress', '?')}: {_describe(n.get('Resources', {}))} ({k} workers)"
        for n, k in zip(alive, fit)
    )
    raise SweepRefused(
        f"{workers} workers each need {_describe(request)} (a node that runs k of them needs k times that), but the "
        f"cluster's nodes hold {sum(fit)} (nodes: {sizes or 'none alive'}). Use nodes with more host memory (a worker "
        "holds 1/num_workers of the state: more workers need less each), a leaner strategy (host_layout: lean, or "
        "nvme_dir), fewer CPUs per worker, or add nodes."
    )


def _how_many(node: dict[str, Any], request: dict[str, float]) -> int:
    have = node.get("Resources", {})
    return min((int(have.get(k, 0.0) // v) for k, v in request.items() if v > 0), default=0)


def _alive(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in nodes if n.get("Alive", n.get("alive", False))]


def _offers(node: dict[str, Any], request: dict[str, float]) -> bool:
    have = node.get("Resources", {})
    return all(have.get(k, 0.0) >= v for k, v in request.items())


def _describe(resources: dict[str, float]) -> str:
    parts = []
    for key in sorted(resources):
        if key.startswith("node:") or key in ("object_store_memory",) or key.startswith("accelerator_type"):
            continue
        value = resources[key]
        parts.append(f"{key} {format_size(value)}" if key == "memory" else f"{key} {value:g}")
    return ", ".join(parts)
