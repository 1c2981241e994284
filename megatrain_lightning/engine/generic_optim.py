"""Any torch optimizer on the host: the optimizer's own ``step()`` over the units' fp32 masters.

The native kernel (engine/optimizer.py, :class:`HostAdamW`) steps a plain AdamW or Adam as each unit's
gradient lands, overlapping backward. Every other ``torch.optim.Optimizer`` (SGD, Adafactor,
``AdamW(amsgrad=True)``, a subclass that overrides ``step``, a user's own), and every optimizer of a run
with several, steps itself: its gradients land and wait for ``step()`` (no overlap), which then

1. lands what is still on its way, clipped as the native step clips (the same norms, the same coefficient),
2. points each parameter at its fp32 master (a block's parameters are views of it between calls; the outer
   parameters are pointed at it for the step) and gives it the landed fp32 gradient as ``.grad``,
3. calls the optimizer's own ``step()``: torch's arithmetic on the values ordinary training has, so the
   result is the same to the bit (fp32 compute; with bf16 the gradient is the engine's bf16 one, in fp32),
4. rewrites the compute copies of the units it stepped (the next forward uploads them).

The optimizer keeps its state itself (``optimizer.state``, keyed by the model's parameters, which the engine
rebinds but never replaces); a checkpoint stores its tensors in safetensors and the rest as JSON
(:meth:`GenericSteps.saved_state`), and refuses in one line a state holding anything else.

Several optimizers (a GAN's generator and discriminator, manual optimization): each owns the units its
parameters live in, so a block's parameters belong to one optimizer (refused otherwise); ``opt.step()``
steps its own units' gradients, ``opt.zero_grad()`` drops only theirs, and a unit no optimizer owns (frozen)
goes with whichever steps next, as a gradient no optimizer reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.engine.optimizer import share_groups

# What a checkpoint's safetensors file holds (checkpoint/stream.py's codes).
_TENSOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)


class GenericHostOptimizer(torch.optim.Optimizer):
    """The user's optimizer as the engine's clients step it: ``step`` lands the gradients and runs the
    optimizer's own step on the host masters, ``zero_grad`` drops its units' gradients. The groups and the
    state are the user's optimizer's own (LR schedulers built on it keep working)."""

    def __init__(self, source: torch.optim.Optimizer, steps: GenericSteps) -> None:
        self._source, self._steps = source, steps
        share_groups(self, source)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer this one stands in for (Lightning's LearningRateMonitor names it by this)."""
        return self._source

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # (the source's list itself, even after it is replaced)
        return self._source.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._source.param_groups = groups

    @property
    def state(self) -> Any:
        return self._source.state

    @state.setter
    def state(self, value: Any) -> None:
        self._source.state = value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # (named by the user's optimizer: Lightning's wrapper calls these methods with itself as `self`)
        with self._steps.stepping(self._source):
            self._steps.engine.optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._steps.engine.host.zero_grad(self._steps.droppable(self._source))

    def state_dict(self, with_moments: bool = True) -> dict[str, Any]:
        """torch.optim's layout; ``with_moments=False``: the param groups alone (a sharded checkpoint stores
        the state itself)."""
        self._steps.engine.flush()
        state = self._source.state_dict()
        return state if with_moments else {"state": {}, "param_groups": state["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._steps.engine.flush()
        self._source.load_state_dict(state_dict)

    def restore_groups(self, saved_groups: list[dict[str, Any]]) -> None:
        """The param groups' settings from a checkpoint, as ``torch.optim.Optimizer.load_state_dict`` leaves
        them (the group dicts and their list stay the same objects: LR schedulers hold them)."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(saved_groups)} param groups, {type(self._source).__name__} "
                f"has {len(self.param_groups)}; resume with the same optimizer configuration"
            )
        for group, saved in zip(self.param_groups, saved_groups):
            kept = {"params": group["params"]}
            if "param_names" in group and "param_names" not in saved:
                kept["param_names"] = group["param_names"]
            settings = {k: _as_before(group.get(k), v) for k, v in saved.items() if k != "params"}
            group.clear()
            group.update(settings, **kept)
        type(self._source).__setstate__(self._source, {"param_groups": self.param_groups, "state": self.state})

    def __repr__(self) -> str:
        return f"GenericHostOptimizer({self._source!r})"


class GenericSteps:
    """The torch optimizers attached to one engine, and the step ``HostSide.step`` hands them
    (engine/host/host_steps.py)."""

    def __init__(self, engine: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        if not engine.ranks.whole_here:
            raise ValueError(
                f"{type(optimizers[0]).__name__} steps itself over whole parameters, which no rank holds with data "
                "parallel over several ranks: use torch.optim.AdamW (its host step is partitioned), or one device"
            )
        for opt in optimizers:
            if isinstance(opt, torch.optim.LBFGS):
                raise ValueError(
                    "torch.optim.LBFGS re-evaluates the loss several times per step, which the streamed backward "
                    "cannot repeat inside one step; use a first-order optimizer"
                )
        self.engine = engine
        self.optimizers = [GenericHostOptimizer(opt, self) for opt in optimizers]
        self._current: GenericHostOptimizer | None = None
        self._owners()  # (refuses what the steps cannot follow)
        groups = {}
        for opt in self.optimizers:
            groups.update((id(p), g) for g, group in enumerate(opt.param_groups) for p in group["params"])
        engine.flush()
        for unit in engine.all_units():
            unit.set_groups(groups)
        engine.host.attach(lambda: [], self._order(self.optimizers), self)  # (no Adam hyper-parameters)

    # -- which optimizer owns what --------------------------------------------------------------------
    def _owners(self) -> dict[int, int]:
        """Unit (by id) -> index of the optimizer owning it; checked: every parameter is the model's, in one
        optimizer, and a unit's parameters in one optimizer. Asked anew at every step (``add_param_group``)."""
        where = {id(e.param): u for u in self.engine.all_units() for e in u.layout}
        by_param: dict[int, int] = {}
        owner: dict[int, int] = {}
        for k, opt in enumerate(self.optimizers):
            for g, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in where:
                        raise ValueError(
                            f"param group {g} of {type(opt.optimizer).__name__} holds tensors that are not parameters "
                            "of the trained model; the host optimizer can only step the model's own parameters"
                        )
                    if by_param.setdefault(id(p), k) != k:
                        raise ValueError(
                            f"a parameter of {where[id(p)].name} is in two optimizers; give each parameter to one"
                        )
                    unit = where[id(p)]
                    if owner.setdefault(id(unit), k) != k:
                        raise ValueError(
                            f"the parameters of {unit.name} are split between optimizers {owner[id(unit)]} and {k}: "
                            "the engine steps a block's parameters together, so give all of a block's parameters "
                            "to one optimizer"
                        )
        return owner

    @staticmethod
    def _order(optimizers: list[GenericHostOptimizer]) -> list[int]:
        """Ids of the optimizers' parameters in group order (what ``clip_grad_norm_`` walks)."""
        return [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]

    def _stepping_now(self) -> list[GenericHostOptimizer]:
        return self.optimizers if self._current is None else [self._current]

    def _taken(self, optimizers: list[GenericHostOptimizer], units: list[HostUnit]) -> list[HostUnit]:
        """Of `units`, those `optimizers` own, and those no optimizer owns."""
        owner = self._owners()
        mine = {k for k, opt in enumerate(self.optimizers) if any(opt is o for o in optimizers)}
        return [u for u in units if owner.get(id(u), -1) in mine or id(u) not in owner]

    def _of(self, source: torch.optim.Optimizer) -> GenericHostOptimizer:
        return next(opt for opt in self.optimizers if opt.optimizer is source)

    def droppable(self, source: torch.optim.Optimizer) -> list[HostUnit]:
        """The units whose gradients the user's optimizer `source`'s ``zero_grad()`` drops."""
        return self._taken([self._of(source)], self.engine.all_units())

    @contextmanager
    def stepping(self, source: torch.optim.Optimizer) -> Iterator[None]:
        """Inside, the engine's optimizer step is that of the user's optimizer `source` (its units, its
        parameters' clipping norm)."""
        opt = self._current = self._of(source)
        self.engine.host.param_order = self._order([opt])
        try:
            yield
        finally:
            self._current = None
            self.engine.host.param_order = self._order(self.optimizers)

    # -- the step, called by HostSide.step -------------------------------------------------------------
    def units(self, pending: list[HostUnit]) -> list[HostUnit]:
        """Of the units holding gradients, those this step takes."""
        return self._taken(self._stepping_now(), pending)

    def step(self, units: list[HostUnit], grads: list[torch.Tensor], scale: float, clamp: float | None) -> None:
        """Run the optimizers' own steps with ``.grad`` the landed fp32 gradient `grads` (per unit, flat),
        clamped to `clamp` or scaled by `scale` first (clip_grad_value_ / clip_grad_norm_), on the masters."""
        outer = self.engine.outer
        outer.bind_masters()
        try:
            for unit, flat in zip(units, grads):
                if clamp is not None:
                    flat.clamp_(-clamp, clamp)
                if scale != 1.0:
                    flat.mul_(scale)
                for e, has in zip(unit.entries, unit.grad.present):
                    e.param.grad = flat[e.offset : e.offset + e.numel].view(e.shape) if has else None
            for opt in self._stepping_now():
                opt.optimizer.step()
        finally:
            for unit in units:
                for e in unit.entries:
                    e.param.grad = None
            outer.bind_device()
        for unit in units:
            unit.refresh_copy()

    # -- checkpoints ------------------------------------------------------------------------------------
    def saved_state(self) -> tuple[list[tuple[str, torch.Tensor]], list[dict]]:
        """Every optimizer's state dict as (tensors for a safetensors file, JSON for the rest); a value that
        is neither a tensor of a stored dtype nor plain JSON is refused in one line."""
        self.engine.flush()
        tensors: list[tuple[str, torch.Tensor]] = []
        meta = []
        for k, opt in enumerate(self.optimizers):
            sd = opt.optimizer.state_dict()
            state: dict[str, dict] = {}
            for idx, entry in sd["state"].items():
                state[str(idx)] = {}
                for key, value in entry.items():
                    where = f"{type(opt.optimizer).__name__}.state[{idx}][{key!r}]"
                    if isinstance(value, torch.Tensor):
                        name = f"{k}.{idx}.{key}"
                        tensors.append((name, _storable(value, where)))
                        state[str(idx)][key] = {"tensor": name}
                    else:
                        state[str(idx)][key] = {"value": _plain(value, where)}
            groups = [
                {key: _plain(v, f"{type(opt.optimizer).__name__}.param_groups[{g}][{key!r}]") for key, v in grp.items()}
                for g, grp in enumerate(sd["param_groups"])
            ]
            meta.append({"class": type(opt.optimizer).__name__, "state": state, "param_groups": groups})
        return tensors, meta

    def load_saved(self, meta: Any, tensors: dict[str, torch.Tensor], url: str) -> None:
        """Restore what :meth:`saved_state` wrote (`tensors` read and checksummed by the store)."""
        if not isinstance(meta, list) or len(meta) != len(self.optimizers):
            raise ValueError(
                f"{url} holds the state of {len(meta) if isinstance(meta, list) else 'no'} torch optimizer(s), this "
                f"run has {len(self.optimizers)}; resume with the same optimizers"
            )
        for opt, saved in zip(self.optimizers, meta):
            try:
                state = {
                    int(idx): {key: tensors[v["tensor"]] if "tensor" in v else v["value"] for key, v in entry.items()}
                    for idx, entry in saved["state"].items()
                }
                now = opt.param_groups
                groups = [
                    {k: _as_before(now[i].get(k) if i < len(now) else None, v) for k, v in stored.items()}
                    for i, stored in enumerate(saved["param_groups"])
                ]
            except (KeyError, TypeError, ValueError, AttributeError):
                raise ValueError(f"{url}: its torch optimizer state is not what a save writes (damaged)") from None
            opt.load_state_dict({"state": state, "param_groups": groups})  # (torch checks the groups' sizes)


def _storable(t: torch.Tensor, where: str) -> torch.Tensor:
    if t.dtype not in _TENSOR_DTYPES or t.is_complex():
        raise ValueError(
            f"{where} is a {t.dtype} tensor, which a checkpoint does not store (it stores "
            f"{', '.join(str(d).removeprefix('torch.') for d in _TENSOR_DTYPES)}); keep optimizer state in those dtypes"
        )
    return t.detach().to("cpu").contiguous()


def _plain(value: Any, where: str) -> Any:
    """`value` as JSON stores it (tuples as lists); ValueError naming `where` for anything JSON does not hold."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where} holds a {type(value).__name__}, which a checkpoint stores neither as a tensor nor as JSON "
            "(it never pickles); keep optimizer state in tensors, numbers, strings, and lists and dicts of them"
        ) from None
    return json.loads(json.dumps(value, allow_nan=True))


def _as_before(current: Any, saved: Any) -> Any:
    """A setting read back from JSON in the type the optimizer had it in (betas: a tuple, not a list)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved
