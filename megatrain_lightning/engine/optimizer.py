"""HostAdamW (``engine.optimizer(opt)``): takes over a user's ``torch.optim.AdamW``/``Adam`` and steps it on the host flat buffers.

It shares the user's ``param_groups`` (the same list of the same dicts), so LR schedulers built on the
user's optimizer keep changing the learning rate this optimizer reads. Its state dict has the layout of
``torch.optim.AdamW.state_dict()`` (per-parameter ``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
move between this strategy and ordinary training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatrain_lightning.engine.host.units import HostUnit, ParamEntry, spans
from megatrain_lightning.optim.kernels import AdamHyper


class Steps(Protocol):
    """What the optimizer asks of the engine (engine.py's ``Engine``, which imports this module)."""

    ranks: Any  # engine/ranks.py's Ranks

    def all_units(self) -> list[HostUnit]: ...

    def attach_optimizer(
        self, groups: dict[int, int], hyper: Callable[[], list[AdamHyper]], order: list[int]
    ) -> None: ...

    def optimizer_step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> None: ...


SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)


def native_ok(optimizer: Any) -> bool:
    """Whether the native host Adam step computes what `optimizer`'s own step would: a torch AdamW or Adam
    (or a subclass that keeps torch's step), with no setting the kernel does not implement. Anything else
    steps itself on the host (engine/generic_optim.py)."""
    base = next((c for c in SUPPORTED if isinstance(optimizer, c)), None)
    # (torch wraps each optimizer class's step in a profiling hook of its own: compare what is wrapped)
    if base is None or any(
        inspect.unwrap(getattr(type(optimizer), m)) is not inspect.unwrap(getattr(base, m))
        for m in ("step", "_init_group")
    ):
        return False
    for group in optimizer.param_groups:
        if any(group.get(flag) for flag in ("amsgrad", "maximize", "differentiable")):
            return False
        if isinstance(group["betas"][0], torch.Tensor) and group["betas"][0].requires_grad:
            return False
    return True


def check_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Refuse what is not a torch optimizer, naming the value and the fix."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"strategy='megatrain' steps torch optimizers on the host; got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}, which is not a torch.optim.Optimizer: subclass torch.optim.Optimizer"
        )
    return optimizer


def share_groups(host: torch.optim.Optimizer, source: torch.optim.Optimizer) -> None:
    """What ``Optimizer.__init__`` would set on `host`, a stand-in stepping `source`'s param groups on the
    host. ``__init__`` itself is skipped on purpose: it would copy the groups, and the point is to share them
    (a scheduler or ``add_param_group`` on either is seen by both)."""
    host.defaults = source.defaults
    for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
        setattr(host, f"_optimizer_{hooks}_hooks", {})
    host._optimizer_load_state_dict_pre_hooks = {}
    host._optimizer_load_state_dict_post_hooks = {}
    host._zero_grad_profile_name = f"megatrain.{type(host).__name__}.zero_grad"


class HostAdamW(torch.optim.Optimizer):
    """An optimizer whose ``step`` runs the engine's host step over all units."""

    def __init__(self, source: torch.optim.Optimizer, engine: Steps) -> None:
        # Optimizer.__init__ is skipped on purpose: it would copy the groups, and the point is to share them.
        if not native_ok(source):
            raise ValueError(
                f"{type(source).__name__} is not a plain torch AdamW/Adam the native host step implements; "
                "engine.optimizer() steps it with its own step() instead"
            )
        self._source = source
        share_groups(self, source)
        self.state: dict = {}
        self.engine = engine
        self._attached: list[tuple[int, int]] = []
        self._attach()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # (the source's list itself, even after it is replaced)
        return self._source.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._source.param_groups = groups

    def _layout(self) -> list[tuple[int, int]]:
        """What the units' group mapping was made from: each group (by identity) and its size. A group added
        (``add_param_group``, as BackboneFinetuning does) or a group's parameters replaced changes it."""
        return [(id(g["params"]), len(g["params"])) for g in self.param_groups]

    def _attach(self) -> None:
        """Map every parameter of the groups to its group on the units (Adam moments allocated the first time)."""
        groups = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        known = {id(e.param) for unit in self.engine.all_units() for e in unit.layout}
        stray = [g for g, group in enumerate(self.param_groups) for p in group["params"] if id(p) not in known]
        if stray:
            raise ValueError(
                f"param group {stray[0]} holds tensors that are not parameters of the trained model; "
                "the host optimizer can only step the model's own parameters"
            )
        order = [id(p) for group in self.param_groups for p in group["params"]]
        self.engine.attach_optimizer(groups, self.hyper, order)
        self._attached = self._layout()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer this one stands in for (the wrapped-optimizer convention Lightning's
        LearningRateMonitor follows, so its keys read e.g. ``lr-AdamW`` as in ordinary training)."""
        return self._source

    def hyper(self) -> list[AdamHyper]:
        """Each group's hyper-parameters as they are now (a scheduler may have just changed lr). The engine
        asks before each step it makes: a param group added since the last one is mapped onto the units
        first, so its parameters step from this step on, with fresh Adam state, as torch.optim's would."""
        if self._layout() != self._attached:
            if not native_ok(self._source):
                raise ValueError(
                    "a param group added to the optimizer sets amsgrad, maximize or differentiable, which the native "
                    "host AdamW does not implement; set them in configure_optimizers (the optimizer then steps itself)"
                )
            self._attach()
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
        # (the engine's ranks, not its units': after engine.close() the masters are whole again, the moments
        # still this rank's shards)
        if with_moments and not self.engine.ranks.whole_here:
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


def optimizer_backend() -> str:
    """Which kernel the host steps run on, as ``megatrain env`` prints it: ``kernels.backend()`` (native or
    torch, as ``MEGATRAIN_CPU_ADAM`` chooses) and what the native library loaded (its ISA, or why not)."""
    from megatrain_lightning.optim import kernels, native  # (native: loaded only where asked, as kernels does)

    return f"{kernels.backend()} (native kernel: {native.backend()})"
