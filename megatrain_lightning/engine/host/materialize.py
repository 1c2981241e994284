"""Models built without their weights: parameters on the meta device, filled unit by unit into the masters.

A model built under :func:`empty_init` (what ``Trainer.init_module(empty_init=True)`` and Fabric's
``init_module(empty_init=True)`` use with strategy="megatrain") has every parameter on the meta device: no
memory and no initialization. Its buffers stay real host tensors, because the non-persistent ones (rotary
``inv_freq``) are computed by the constructor and in no checkpoint. The engine then allocates each unit's
flat fp32 master and fills it here, one unit at a time, so no fp32 model ever exists beside the masters:

    checkpoint   a parameter that ``load_hf_weights`` has named a checkpoint tensor for: the tensor is read
                 (one at a time, its file mapped only meanwhile) and converted into the master (models/hf_io.py)
    init         otherwise the module's own initialization, run on the views of the master once all of a
                 module's parameters are there: ``_init_weights(module)`` of the innermost model around it
                 that has one (Hugging Face's protocol, which this project's Llama follows), else the
                 module's ``reset_parameters()``. Nothing is initialized twice, and nothing that a
                 checkpoint fills is initialized at all.

In ``configure_model`` (which Lightning runs under ``init_module()`` without empty_init) the same is had by
building inside ``megatrain_lightning.empty_init()``. A model built on the meta device in any other way
(``with torch.device("meta")``) is filled the same way, provided it has no buffers on meta.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.models.hf_io import SOURCE_ATTR  # (set by the checkpoint loader, read and removed here)

_local = threading.local()  # the hook below is process-wide; only the thread inside empty_init() is affected


def _to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if not getattr(_local, "active", False) or param is None or param.is_meta:
        return None  # (a tie re-registers a parameter that is on the meta device already)
    guarded = _local.guarded
    if module not in guarded:
        guarded.add(module)
        module.register_load_state_dict_pre_hook(_memory_for_load)
    return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


@contextmanager
def empty_init() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (each is created on the host as the
    module asks, uninitialized, and replaced at registration, so at most one parameter is ever allocated;
    the init the constructor runs afterwards is a no-op on meta) and keep real host buffers."""
    if getattr(_local, "active", False):
        yield
        return
    _local.active, _local.guarded = True, weakref.WeakSet()
    handle = register_module_parameter_registration_hook(_to_meta)
    try:
        with torch.device("cpu"):  # not the accelerator: each parameter exists there only until it is registered
            yield
    finally:
        handle.remove()
        _local.active, _local.guarded = False, None


def building_empty() -> bool:
    """Whether this thread is inside :func:`empty_init` (a loader then leaves the parameters on meta)."""
    return getattr(_local, "active", False)


def _memory_for_load(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_) -> None:
    """``load_state_dict`` copies into parameters, and a copy into a meta tensor silently does nothing: each
    meta parameter the state dict names gets host memory first (the same object, its contents swapped), so
    the load is the ordinary one (``LightningModule.load_from_checkpoint`` under ``init_module(empty_init=True)``
    included). The state dict is a whole model in memory anyway; the engine copies the loaded parameters."""
    if local_metadata.get("assign_to_params_buffers", False):
        return
    for name, p in module._parameters.items():
        if p is not None and p.is_meta and prefix + name in state_dict:
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
            p.__dict__.update(attrs)


def empty_params(model: nn.Module) -> set[int]:
    """Ids of the model's parameters on the meta device, each now made a host placeholder (one NaN, expanded
    to its shape: no memory) that the engine can bind to its master; a buffer there is refused (nothing could
    fill it). The parameter stays the same object (the optimizer and tied modules hold it): its contents are
    swapped, its attributes kept."""
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise ValueError(
                f"buffer {name!r} is on the meta device, and strategy='megatrain' fills only parameters from a "
                "checkpoint or their init: build the model under trainer.init_module(empty_init=True) (or "
                "fabric.init_module(empty_init=True)), which keeps buffers real, instead of torch.device('meta')"
            )
    empty = [p for p in model.parameters() if p.is_meta]
    nan = torch.full((), math.nan)
    for p in empty:
        attrs = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(nan.expand(p.shape), requires_grad=p.requires_grad))
        p.__dict__.update(attrs)
    return {id(p) for p in empty}


@torch.no_grad()
def fill_units(model: nn.Module, units: list[HostUnit], empty: set[int]) -> None:
    """Fill the masters of the parameters in `empty` (ids, see :func:`empty_params`), unit by unit: from the
    checkpoint tensor each names, else by its module's init once all of the module's parameters have memory."""
    if not empty:
        return
    init_of = _initializers(model)
    waiting = _owners_waiting(model, empty)  # module -> its direct parameters still to be filled
    unit_of = {id(e.param): u for u in units for e in u.entries}
    stale: dict[HostUnit, None] = {}  # units an init wrote into after their compute copy was refreshed
    loaded: set[int] = set()  # filled from a checkpoint
    for unit in units:
        todo = [e for e in unit.entries if id(e.param) in empty]
        if not todo:
            continue
        for e in todo:
            source = getattr(e.param, SOURCE_ATTR, None)
            if source is not None:
                flat = source().reshape(-1)
                unit.master[e.offset : e.offset + e.numel].copy_(flat[e.start : e.start + e.numel])
                del flat  # our only reference: the next tensor is read into its memory
                loaded.add(id(e.param))
        if any(id(e.param) not in loaded for e in todo):
            _refuse_partitioned(unit)
            unit.bind_host()  # (a block's are views already; an outer parameter's are bound to the device later)
        done = {id(e.param) for e in todo}
        for module in [m for m, ids in waiting.items() if ids & done]:
            waiting[module] -= done
            if not waiting[module]:
                del waiting[module]
                if _needs_init(module, empty, loaded):
                    _run_init(module, init_of)
                    stale.update((unit_of[id(p)], None) for p in module.parameters(recurse=False) if id(p) in unit_of)
        unit.refresh_copy()
        stale.pop(unit, None)
    for unit in stale:
        unit.refresh_copy()
    for p in model.parameters():
        if hasattr(p, SOURCE_ATTR):
            delattr(p, SOURCE_ATTR)


def _needs_init(module: nn.Module, empty: set[int], loaded: set[int]) -> bool:
    """Whether `module`'s meta parameters need its init (none was loaded); some loaded and some not is refused."""
    names = [n for n, p in module.named_parameters(recurse=False) if id(p) in empty and id(p) not in loaded]
    if names and len(names) < sum(id(p) in empty for p in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} got some of its parameters from the checkpoint but not {names}, and its "
            "init would overwrite the loaded ones: load a checkpoint that holds all of them"
        )
    return bool(names)


def _refuse_partitioned(unit: HostUnit) -> None:
    if unit.partitioned:
        raise ValueError(
            f"{unit.name} was built on the meta device and no checkpoint fills it, but with data parallel no rank "
            "holds a whole parameter to run its init on: load the weights with "
            "megatrain_lightning.load_hf_weights(model, directory), or build the model with empty_init=False"
        )


def _run_init(module: nn.Module, init_of: Callable) -> None:
    for p in module.parameters(recurse=False):
        if getattr(p, "_is_hf_initialized", False):
            del p._is_hf_initialized  # set at construction, on meta: nothing was initialized
    init_of(module)()


def _owners_waiting(model: nn.Module, empty: set[int]) -> dict[nn.Module, set[int]]:
    """Each module holding meta parameters directly -> the ids of those parameters."""
    out: dict[nn.Module, set[int]] = {}
    for module in model.modules():
        ids = {id(p) for p in module.parameters(recurse=False) if id(p) in empty}
        if ids:
            out[module] = ids
    return out


def _initializers(model: nn.Module) -> Callable[[nn.Module], Callable[[], None]]:
    """module -> the call that initializes its own parameters: the innermost Hugging Face model's
    ``_init_weights(module)`` around it, else ``module.reset_parameters``."""
    hf: dict[nn.Module, nn.Module] = {}
    for m in model.modules():  # pre-order: an inner Hugging Face model overrides its outer one
        if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config"):
            hf.update((sub, m) for sub in m.modules())

    def init_of(module: nn.Module) -> Callable[[], None]:
        if module in hf:
            return lambda: hf[module]._init_weights(module)
        # (nn.MultiheadAttention's own parameters have the private name)
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(reset):
            return reset
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise ValueError(
            f"{type(module).__name__} (parameters {names}) was built on the meta device and has no "
            "reset_parameters(), and no checkpoint names its weights: load them with "
            "megatrain_lightning.load_hf_weights(model, directory), give the module a reset_parameters(), or "
            "build the model with empty_init=False"
        )

    return init_of
