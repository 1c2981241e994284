"""HostAdamW (``engine.optimizer(opt)``): takes over a user's ``torch.optim.AdamW``/``Adam`` and steps it on the host flat buffers.

It shares the user's ``param_groups`` (the same list of the same dicts), so LR schedulers built on the
user's optimizer keep changing the learning rate this optimizer reads. Its state dict has the layout of
``torch.optim.AdamW.state_dict()`` (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
move between this strategy and ordinary training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatrain_lightning.engine.host import HostUnit, ParamEntry, spans
from megatrain_lightning.optim.kernels import AdamHyper


class Steps(Protocol):
    """What the optimizer asks of the engine (engine.py's ``Engine``, which imports this module)."""

    def all_units(self) -> list[HostUnit]: ...

    def attach_optimizer(
        self, groups: dict[int, int], hyper: Callable[[], list[AdamHyper]], order: list[int]
    ) -> None: ...

    def optimizer_step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> None: ...


SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)


def check_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Refuse what the host step cannot reproduce, naming the value and the fix."""
    if type(optimizer) not in SUPPORTED:
        raise ValueError(
            f"strategy='megatrain' steps the optimizer on the host and supports torch.optim.AdamW and "
            f"torch.optim.Adam; configure_optimizers returned {type(optimizer).__module__}.{type(optimizer).__name__}. "
            "Return one of those (its param groups, learning rates and schedulers are kept)."
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"param group {i} sets {flag}=True, which the host AdamW does not implement; drop it")
        if isinstance(group["betas"][0], torch.Tensor) and group["betas"][0].requires_grad:
            raise ValueError(f"param group {i}: tensor betas that require grad are not supported")
    return optimizer


class HostAdamW(torch.optim.Optimizer):
    """An optimizer whose ``step`` runs the engine's host step over all units."""

    def __init__(self, source: torch.optim.Optimizer, engine: Steps) -> None:
        # Optimizer.__init__ is skipped on purpose: it would copy the groups, and the point is to share them.
        self._source = check_optimizer(source)
        self.defaults = source.defaults
        self.param_groups = source.param_groups
        self.state: dict = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._zero_grad_profile_name = "megatrain.HostAdamW.zero_grad"
        self.engine = engine
        groups = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        known = {id(e.param) for unit in engine.all_units() for e in unit.layout}
        stray = [g for g, group in enumerate(self.param_groups) for p in group["params"] if id(p) not in known]
        if stray:
            raise ValueError(
                f"param group {stray[0]} holds tensors that are not parameters of the trained model; "
                "the host optimizer can only step the model's own parameters"
            )
        order = [id(p) for group in self.param_groups for p in group["params"]]
        engine.attach_optimizer(groups, self.hyper, order)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer this one stands in for (the wrapped-optimizer convention Lightning's
        LearningRateMonitor follows, so its keys read e.g. ``lr-AdamW`` as in ordinary training)."""
        return self._source

    def hyper(self) -> list[AdamHyper]:
        """Each group's hyper-parameters as they are now (a scheduler may have just changed lr)."""
        decoupled_default = isinstance(self._source, torch.optim.AdamW)
        return [
            AdamHyper(
                lr=float(g["lr"]),
                beta1=float(g["betas"][0]),
                beta2=float(g["betas"][1]),
                eps=float(g["eps"]),
                weight_decay=float(g["weight_decay"]),
                decoupled=bool(g.get("decoupled_weight_decay", decoupled_default)),
            )
            for g in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.optimizer_step()
        self._source._opt_called = True  # tells LR schedulers built on the source that a step happened
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    # -- state dict in torch.optim layout ---------------------------------------------------------
    def _entries(self) -> dict[int, tuple[Any, int, ParamEntry]]:
        """Where each parameter (by id) lives: its unit and its index among the unit's entries."""
        return {id(e.param): (u, i, e) for u in self.engine.all_units() for i, e in enumerate(u.entries)}

    def state_dict(self, with_moments: bool = True) -> dict[str, Any]:
        """torch.optim's layout. ``with_moments=False`` leaves ``state`` empty: the param groups alone, for a
        checkpoint that stores the moments itself (gathering them would hold every moment in memory at once,
        and read all of them back from the NVMe tier)."""
        self.engine.flush()
        # (the engine's partition, not its units': after engine.close() the masters are whole again, the
        # moments still this rank's shards)
        part = getattr(self.engine, "partition", None)
        if with_moments and (part is not None or any(u.partitioned for u in self.engine.all_units())):
            raise RuntimeError(
                "optimizer.state_dict() gathers every Adam moment into this process, but each data-parallel rank "
                "holds 1/W of them; save a checkpoint (engine.save, before engine.close()) instead"
            )
        where, state, index, groups = self._entries() if with_moments else {}, {}, 0, []
        moments = self._stepped_moments() if with_moments else {}
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                unit, i, _ = where.get(id(p), (None, 0, None))  # (no moments asked for: no lookup)
                if unit is not None and unit.steps[i] > 0:  # torch.optim keeps state only for parameters it has stepped
                    exp_avg, exp_avg_sq = moments[id(p)]
                    state[index] = {
                        "step": torch.tensor(float(unit.steps[i])),
                        "exp_avg": exp_avg,
                        "exp_avg_sq": exp_avg_sq,
                    }
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def _stepped_moments(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """(exp_avg, exp_avg_sq) of every stepped parameter, by id: views of the host moments, or copies
        where they come from the NVMe tier (its working buffer is reused once the unit is done)."""
        out = {}
        for unit in self.engine.all_units():
            stepped = [e for e, step in zip(unit.entries, unit.steps) if step > 0]
            if not stepped:
                continue
            if unit.tier is None:
                out.update(
                    (
                        id(e.param),
                        (
                            unit.m[e.offset : e.offset + e.numel].view(e.shape),
                            unit.v[e.offset : e.offset + e.numel].view(e.shape),
                        ),
                    )
                    for e in stepped
                )
                continue
            out.update((id(e.param), (torch.empty(e.shape), torch.empty(e.shape))) for e in stepped)
            for lo, hi, m, v in unit.moment_pieces(write=False, only=spans(stepped)):
                for e, a, b in unit.overlaps(lo, hi, stepped):
                    for dst, src in zip(out[id(e.param)], (m, v)):
                        dst.view(-1)[a - e.offset : b - e.offset].copy_(src[a - lo : b - lo])
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.flush()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "the optimizer state in the checkpoint has a different number of param groups or parameters "
                "than configure_optimizers returned; resume with the same optimizer configuration"
            )
        loaded: dict[int, dict | None] = {}  # by parameter id: its saved state, None when never stepped
        for saved, group in zip(saved_groups, self.param_groups):
            loaded.update((id(p), state_dict["state"].get(idx)) for idx, p in zip(saved["params"], group["params"]))
        self.restore_groups(saved_groups)
        held = {id(e.param) for unit in self.engine.all_units() for e in unit.layout}
        if not loaded.keys() <= held:
            raise ValueError(
                f"the optimizer's param groups name {len(loaded.keys() - held)} parameter(s) the streaming engine "
                "does not hold; build the optimizer from the parameters of the model the strategy was set up with"
            )
        for unit in self.engine.all_units():
            if any(id(e.param) in loaded for e in unit.entries):
                self._load_unit(unit, loaded)

    def restore_groups(self, saved_groups: list[dict[str, Any]]) -> None:
        """The param groups' settings from a checkpoint, exactly as ``torch.optim.Optimizer.load_state_dict``
        leaves them: each group becomes the saved one with its own parameters (a setting the saved group lacks
        is dropped, then the optimizer class's defaults fill in), whatever configure_optimizers asked for
        this run. The group dicts and their list stay the same objects: LR schedulers and Lightning's
        optimizer wrapper hold them."""
        for group, saved in zip(self.param_groups, saved_groups):
            kept = {"params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                kept["param_names"] = group["param_names"]
            group.clear()
            group.update({k: v for k, v in saved.items() if k != "params"}, **kept)
        # The optimizer class's own defaults for missing settings (AdamW.__setstate__), on the same list.
        type(self._source).__setstate__(self._source, {"param_groups": self.param_groups})

    @staticmethod
    def _load_unit(unit: Any, loaded: dict[int, dict | None]) -> None:
        """Write the saved state of `unit`'s parameters into its moments (a read and a write of each piece
        on the tier). A parameter never stepped gets fresh Adam state, as torch.optim would have."""
        named = [e for e in unit.entries if id(e.param) in loaded]
        for lo, hi, m, v in unit.moment_pieces(only=spans(named)):
            for e, a, b in unit.overlaps(lo, hi, named):
                entry = loaded[id(e.param)]
                for dst, key in ((m, "exp_avg"), (v, "exp_avg_sq")):
                    if entry is None:
                        dst[a - lo : b - lo].zero_()
                    else:
                        # (e.start: a piece of a partitioned unit begins that far into its parameter)
                        saved = entry[key].reshape(-1)[e.start + a - e.offset : e.start + b - e.offset]
                        dst[a - lo : b - lo].copy_(saved)
        for i, e in enumerate(unit.entries):
            if id(e.param) in loaded:
                entry = loaded[id(e.param)]
                unit.steps[i] = 0 if entry is None else int(entry["step"])
