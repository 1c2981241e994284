"""Per-block autograd: forward without a graph, backward by recomputing the block with its weights re-bound.

Each decoder block's ``forward`` is replaced by a :class:`BlockRunner`. Under grad mode the runner goes
through :class:`_BlockFunction`, which saves only the block's input hidden state; its backward asks the
engine to bring the block's weights back into a slot, recompute the block with grad and return the
input's gradient. The weights' gradients never enter autograd's graph: the engine ships them to host
memory as soon as they exist. So ``loss.backward()``, ``manual_backward`` and any loss a user writes
work unchanged.

Like ``torch.utils.checkpoint``, the recompute runs under the autocast state and from the RNG state the
forward saw, so dropout masks and mixed-precision casts are the same both times.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from megatrain_lightning.engine.engine import StreamingEngine

_CACHE_KWARGS = ("past_key_values", "past_key_value")


class CallState:
    """Everything besides the hidden state that a block call needs, captured at forward time."""

    def __init__(self, args: tuple, kwargs: dict, device: torch.device, preserve_rng: bool) -> None:
        if args:
            self.hidden, self.args, self.hidden_kw = args[0], args[1:], None
        elif "hidden_states" in kwargs:
            self.hidden, self.args, self.hidden_kw = kwargs["hidden_states"], (), "hidden_states"
        else:
            raise TypeError("a streamed block must get its hidden state as the first argument or `hidden_states=`")
        self.kwargs = {k: v for k, v in kwargs.items() if k != self.hidden_kw}
        _refuse_grad_inputs(self.args, self.kwargs)
        self.extra: tuple | None = None  # non-hidden outputs of a block that returns a tuple
        self.kind: type | None = None
        types = {"cpu", device.type}
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
            for t in sorted(types)
        ]
        self.cuda_device = device if device.type == "cuda" else None
        self.cpu_rng = torch.get_rng_state() if preserve_rng else None
        self.dev_rng = torch.cuda.get_rng_state(device) if preserve_rng and self.cuda_device is not None else None

    def call(self, module: torch.nn.Module, params: dict[str, torch.Tensor], hidden: torch.Tensor) -> Any:
        """Run `module` with `params` bound in place of its own, on `hidden`."""
        kwargs = dict(self.kwargs)
        if self.hidden_kw is None:
            args = (hidden, *self.args)
        else:
            args, kwargs[self.hidden_kw] = self.args, hidden
        return torch.func.functional_call(module, params, args, kwargs)

    def split(self, out: Any) -> torch.Tensor:
        """The hidden-state output; a tuple's other elements are kept for :meth:`rebuild`."""
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            self.kind, self.extra = type(out), tuple(out[1:])
            return out[0]
        raise TypeError(f"a streamed block must return a tensor or a tuple starting with one, got {type(out).__name__}")

    def rebuild(self, hidden: torch.Tensor) -> Any:
        return hidden if self.kind is None else self.kind((hidden, *self.extra))

    @contextmanager
    def replay(self) -> Iterator[None]:
        """The autocast state and RNG state the forward ran under."""
        with ExitStack() as stack:
            if self.cpu_rng is not None:
                devices = [self.cuda_device] if self.cuda_device is not None else []
                stack.enter_context(torch.random.fork_rng(devices=devices))
                torch.set_rng_state(self.cpu_rng)
                if self.dev_rng is not None:
                    torch.cuda.set_rng_state(self.dev_rng, self.cuda_device)
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            yield


class _BlockFunction(torch.autograd.Function):
    """Autograd node of one streamed block. `anchor` requires grad so the block's weights get gradients
    even when its input does not (e.g. a frozen embedding feeding the first block)."""

    @staticmethod
    def forward(ctx, runner: "BlockRunner", state: CallState, anchor: torch.Tensor, hidden: torch.Tensor):
        ctx.runner, ctx.state = runner, state
        ctx.save_for_backward(hidden)
        return runner.engine.forward_block(runner.idx, state, hidden)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        need_input_grad = ctx.needs_input_grad[3]
        grad_in = ctx.runner.engine.backward_block(ctx.runner.idx, ctx.state, hidden, grad_out, need_input_grad)
        return None, None, None, grad_in


class BlockRunner:
    """Stands in for a decoder block's ``forward``; the block module itself stays in the model."""

    def __init__(self, engine: "StreamingEngine", idx: int) -> None:
        self.engine, self.idx = engine, idx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if torch.is_grad_enabled():
            kwargs = _drop_cache(kwargs)
        state = CallState(args, kwargs, engine.device, engine.preserve_rng_state)
        if not torch.is_grad_enabled():
            # Evaluation: stream the weights, keep no input and build no graph.
            return state.rebuild(engine.forward_block(self.idx, state, state.hidden))
        out = _BlockFunction.apply(self, state, engine.grad_anchor, state.hidden)
        return state.rebuild(out)


def _drop_cache(kwargs: dict) -> dict:
    """Training never reads a KV cache, and filling one would keep every layer's keys on the device."""
    if not any(kwargs.get(k) is not None for k in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return kwargs
    if not getattr(_drop_cache, "warned", False):
        _drop_cache.warned = True
        warnings.warn("strategy='megatrain': the KV cache is disabled while training (use_cache=False)", stacklevel=4)
    out = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _refuse_grad_inputs(args: tuple, kwargs: dict) -> None:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        raise NotImplementedError(
            "a streamed block got a tensor argument besides its hidden state that requires grad; the engine "
            "returns a gradient for the hidden state only. Pass such tensors detached, or compute them inside the block."
        )


