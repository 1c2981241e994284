"""Lightning's weight averaging callbacks (EMA, SWA) under strategy='megatrain': they read the masters, and what
they write becomes the training state.

``WeightAveraging`` (``EMAWeightAveraging`` and user subclasses) and ``StochasticWeightAveraging`` read and
write ``pl_module``'s parameters in place, between steps. Under the engine an outer parameter (embedding,
final norm, head) is then a view of its device copy in the compute dtype, and a block's parameters are views
of masters the host worker may still be stepping. So each place where a callback touches the module runs
inside :meth:`Engine.host_view <megatrain_lightning.engine.engine.Engine.host_view>`: every host step done,
every parameter its fp32 master, as ordinary training shows them; after a write the compute copies, device
copies and slots are rewritten from the masters, so the written weights are trained on, validated with,
saved and handed back at teardown.

| callback                  | touches ``pl_module`` in                                  | view  |
|---------------------------|-----------------------------------------------------------|-------|
| WeightAveraging           | ``AveragedModel.update_parameters`` (after a step / epoch)  | read  |
|                           | ``_swap_models`` (validation), ``_copy_average_to_current``  | write |
|                           | (end of training), ``on_load_checkpoint``                    |       |
| StochasticWeightAveraging | ``update_parameters`` (epoch start), ``transfer_weights``    | read, |
|                           |                                                            | write |
| either, subclassed        | any hook of ``EDGE_HOOKS`` the subclass defines itself     | write |

Reads wait only where an average is updated (a schedule that updates every 10th step keeps the host steps
overlapping the next forward on the other 9). Each callback is patched on the instance, at the strategy's
setup, and restored at its teardown.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from torch import nn

from megatrain_lightning.engine import Engine

# Hooks that run between steps while the engine exists (not inside a forward, backward or optimizer step, and
# not on_fit_end, which comes after the strategy's teardown): a view may be taken there.
EDGE_HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_batch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
)


class AveragingViews:
    """The patches that route the averaging callbacks' reads and writes through the engine's host view."""

    def __init__(self, callbacks: list[Callback], module: nn.Module, engine: Callable[[], Engine | None]) -> None:
        """Check and patch every averaging callback in `callbacks`; `engine()` is the strategy's engine now."""
        self._engine = engine
        self._patched: list[tuple[Any, str, Any]] = []  # (object, attribute, its own instance value or _ABSENT)
        # WeightAveraging's on_load_checkpoint takes its average from the checkpoint's state dict.
        self.reads_state_dict = any(isinstance(cb, WeightAveraging) for cb in callbacks)
        for cb in callbacks:
            if isinstance(cb, StochasticWeightAveraging):
                check_swa(module)
                self._patch(cb, "update_parameters", write=False)
                self._patch(cb, "transfer_weights", write=True)
                self._patch_subclass_hooks(cb, StochasticWeightAveraging)
            elif isinstance(cb, WeightAveraging):
                if cb._average_model is not None:  # (made by the callback's setup, for fit only)
                    self._patch(cb._average_model, "update_parameters", write=False)
                for name in ("_swap_models", "_copy_average_to_current", "on_load_checkpoint"):
                    self._patch(cb, name, write=True)
                self._patch_subclass_hooks(cb, WeightAveraging)

    def _patch_subclass_hooks(self, cb: Callback, base: type) -> None:
        """A hook a user's subclass defines may read or write the module anywhere: a writing view around it."""
        for name in EDGE_HOOKS:
            if getattr(type(cb), name) is not getattr(base, name):
                self._patch(cb, name, write=True)

    def _patch(self, obj: Any, name: str, write: bool) -> None:
        if any(o is obj and n == name for o, n, _ in self._patched):
            return  # (a subclass hook that is also patched by name)
        own = obj.__dict__.get(name, _ABSENT)
        inner = getattr(obj, name)

        @wraps(inner)
        def viewed(*args: Any, **kwargs: Any) -> Any:
            engine = self._engine()
            if engine is None:
                return inner(*args, **kwargs)
            with engine.host_view(write=write):
                return inner(*args, **kwargs)

        object.__setattr__(obj, name, viewed)  # (an nn.Module's own __setattr__ would be the same here)
        self._patched.append((obj, name, own))

    def restore(self) -> None:
        """Give every patched object its own attributes back."""
        for obj, name, own in reversed(self._patched):
            if own is _ABSENT:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, own)
        self._patched.clear()


_ABSENT = object()

# The key under which WeightAveraging.on_save_checkpoint moves the module's own state when it puts its
# average in the checkpoint's "state_dict".
AVERAGED_STATE = "current_model_state"


def check_swa(module: nn.Module) -> None:
    """SWA recomputes BatchNorm statistics in an extra epoch without backward and optimizer step, which the
    engine does not run (a streamed block's buffers are its device copies only while it runs)."""
    if StochasticWeightAveraging.pl_module_contains_batch_norm(module):
        raise ValueError(
            "StochasticWeightAveraging on a model with BatchNorm layers is not supported by strategy='megatrain' "
            "(its extra epoch recomputes batch statistics without backward); remove the callback or the BatchNorm layers"
        )
