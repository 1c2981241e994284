"""Per-block autograd: forward keeping no graph, backward by recomputing the block with its weights re-bound.

Each decoder block's ``forward`` is replaced by a :class:`BlockRunner`. The block still runs as the user's
own module: the same object, in the train/eval mode the user set, with its submodules' hooks; only its
parameters are pointed at device weights for the duration of the call. Under grad mode the runner goes
through :class:`_BlockFunction`, which saves only the block's input hidden state; its backward asks the
engine to bring the block's weights back into a slot, recompute the block with grad and return the
input's gradient. The weights' gradients never enter autograd's graph: the engine ships them to host
memory as soon as they exist. So ``loss.backward()``, ``manual_backward`` and any loss a user writes
work unchanged.

A block may return any tree of tensors (a tuple, a dict, a dataclass, a ``ModelOutput``; engine/device/block_state.py
takes it apart). Tensors that leave a block other than through its hidden-state output (router logits a
hook records for an MoE auxiliary loss, an ``aux_loss`` attribute a router sets, the other tensors of the
output) are made outputs of the same autograd node, so a loss built from them sends its gradient into the
block's recompute as it would in ordinary training. Tensor arguments besides the hidden state that require
grad (an encoder's output for cross-attention, a position bias the first block made) are inputs of the
node: the recompute takes their gradients too and autograd sends them where the tensors came from. What
the forward changes of the block's buffers and plain attributes is replayed, not repeated
(engine/device/block_state.py's ``Mutations``). Like ``torch.utils.checkpoint``, the recompute runs under
the autocast state and from the RNG state the forward saw, and the submodules' hooks fire again in it.

Forward and recompute hand the block tensors with the same ``requires_grad`` flags (parameters as the
user set them, the input as it arrived), and both run in grad mode, as ordinary training's forward does
(the forward saving nothing for backward: engine/device/recompute.py ``nothing_saved``): some kernels pick their
path from those flags and the mode (CPU attention whose additive mask requires grad), and the same path
all three times keeps the loss and the gradients bit for bit those of ordinary training. So a side output
computed without grad (T5's cross-attention bias of zeros) leaves the node not requiring grad either.

Why one file of about 530 lines: a block call's state (:class:`CallState`), its autograd node, its runner and its
compiled form are the four sides of one call, each reading the others' fields; split, each file would import the
rest back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from megatrain_lightning.engine.device.block_state import InputChain, Mutations, flatten
from megatrain_lightning.engine.device.kept_attention import KEPT_CALL, Tape
from megatrain_lightning.engine.device.replay import HostRngs, direct_checkpoints
from megatrain_lightning.engine.device.rows import rows_of
from megatrain_lightning.engine.device.sinks import Sinks


class Streamer(Protocol):
    """What a block's runner asks of the engine (engine/device/streamer.py's ``BlockStreamer``, which imports this
    module)."""

    device: torch.device
    preserve_rng_state: bool
    grad_anchor: torch.Tensor
    saved_inputs: Any
    units: list[Any]  # (each block's host unit: its name names the block in errors)
    input_chain: InputChain

    def forward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, input_requires_grad: bool, record: bool = True
    ) -> tuple: ...

    def backward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, grads_out: list, needs: tuple[bool, ...]
    ) -> tuple: ...

    def offloads_call(self, idx: int, hidden: torch.Tensor) -> bool: ...

    def chunks_call(self, idx: int, hidden: torch.Tensor) -> int | None: ...

    def keeps_call(self, idx: int, hidden: torch.Tensor) -> bool: ...

    def attention_tape(self, idx: int) -> Tape | None: ...


class CallState:
    """Everything besides the hidden state that a block call needs, captured at forward time.

    It deliberately holds no reference to the hidden state, and :meth:`clear` drops the rest once the
    block's backward has run: autograd keeps a node's ``ctx`` alive as long as the graph object lives
    (e.g. a loss the user keeps), and a stale input here would hold device memory for every block.
    """

    def __init__(self, args: tuple, kwargs: dict, device: torch.device, preserve_rng: bool) -> None:
        if args:
            self.args, self.hidden_kw = args[1:], None
        elif "hidden_states" in kwargs:
            self.args, self.hidden_kw = (), "hidden_states"
        else:
            raise TypeError("a streamed block must get its hidden state as the first argument or `hidden_states=`")
        self.kwargs = {k: v for k, v in kwargs.items() if k != self.hidden_kw}
        # Detached stand-ins of the arguments that require grad (the first `chained`), then the shared
        # parameters the block uses (themselves: the block reads them as attributes, not as arguments).
        self.grad_inputs: list[torch.Tensor] = []
        self.chained = 0
        self.keep = False  # the call keeps its graph from the forward (engine/device/recompute.py)
        self.kept: Any = None  # that graph (recompute.KeptGraph), until the backward
        self.unsplit: Callable[[torch.Tensor, tuple], Any] = lambda hidden, extra: hidden  # see split()
        self.extra: tuple = ()  # the output's other leaves
        self.own_input: torch.Tensor | None = None  # the forward's detached input, until the output is rebuilt
        self.changed: Mutations | None = None  # what the forward changed of the block's state
        self.sinks: Sinks | None = None  # lists and dicts among the arguments (engine/device/sinks.py)
        self.host_rngs: HostRngs | None = None  # random, NumPy and the block's generators (engine/device/replay.py)
        self.recorded = 0  # how many tensors SideOutputs recorded in the forward
        self.side_index: list[int] = []  # which of them are outputs of the autograd node
        self.extra_ids: dict[int, int] = {}  # id of a tensor in `extra` -> its index among those outputs
        self.offload = False  # this call saves its input in host memory (the engine's decision for its pass)
        self.saved: Any = None  # the input in host memory when the call offloads it
        self.row_chunk: int | None = None  # rows a chunk of this call computes (None: whole; engine/device/rows.py)
        self.row_spans: list[tuple[int, int]] = []  # the call ran in these chunks of rows
        self.chunk_prints: list[Any] = []  # the forward's fingerprint of each chunk's output
        self.drew = False  # the chunked forward drew random numbers (refused: engine/device/rows.py)
        self.tape: Tape | None = None  # its attention outputs kept for the recompute (engine/device/kept_attention.py)
        types = {"cpu", device.type}
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
            for t in sorted(types)
        ]
        self.cuda_device = device if device.type == "cuda" else None
        self.cpu_rng = torch.get_rng_state() if preserve_rng else None
        self.dev_rng = torch.cuda.get_rng_state(device) if preserve_rng and self.cuda_device is not None else None

    @staticmethod
    def hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def take_grad_inputs(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors among the captured arguments that require grad, each once: they become inputs of the
        block's autograd node, and the captured arguments hold detached stand-ins of them (requiring grad,
        as the forward and the recompute both see them). Holding no graph, a call state keeps no other
        node alive. `params` (shared parameters the block uses, requiring grad) are inputs of the node too,
        after those, each its own stand-in."""
        leaves, unflatten = flatten((self.args, self.kwargs))
        stand_ins: dict[int, torch.Tensor] = {}
        originals = []
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in stand_ins:
                stand_ins[id(t)] = t.detach().requires_grad_(True)
                originals.append(t)
        if originals:
            self.args, self.kwargs = unflatten([stand_ins.get(id(t), t) for t in leaves])
            self.grad_inputs = [stand_ins[id(t)] for t in originals]
        self.chained = len(originals)
        self.grad_inputs += params
        return originals

    def call(self, forward: Callable[..., Any], hidden: torch.Tensor, rows: tuple[int, int, int] | None = None) -> Any:
        """Run the block's own forward on `hidden` with the captured arguments (each run on its own copy of
        the lists and dicts among them: engine/device/sinks.py); `rows` (rows of the call, start, end): `hidden` is
        that chunk of the call's rows, and so are the per-row arguments it gets (engine/device/rows.py)."""
        args, kwargs = (self.args, self.kwargs) if self.sinks is None else self.sinks.fresh()
        if rows is not None:
            args, kwargs = rows_of((args, kwargs), *rows)
        grad = torch.is_grad_enabled()
        tape = self.tape if grad else None
        with direct_checkpoints() if grad else nullcontext(), tape.running() if tape is not None else nullcontext():
            if self.hidden_kw is None:
                out = forward(hidden, *args, **kwargs)
            else:
                out = forward(*args, **{**kwargs, self.hidden_kw: hidden})
        if self.sinks is not None:
            self.sinks.collect({id(hidden), *map(id, self.grad_inputs[: self.chained])})
        return out

    def sunk(self) -> list[torch.Tensor]:
        """The tensors the latest run put into the lists and dicts it was passed (side outputs)."""
        return [] if self.sinks is None else self.sinks.tensors

    @staticmethod
    def split(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor, tuple], Any], tuple]:
        """(hidden-state output: the first floating-point tensor of the output's tree, the function that puts
        a hidden state and the other leaves back into that tree, the other leaves)."""
        leaves, unflatten = flatten(out)
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise TypeError(
                f"a streamed block must return a tensor, or a tuple, list, dict, dataclass or ModelOutput holding "
                f"tensors; got {type(out).__name__} with none"
            )
        at = next((i for i in tensors if leaves[i].is_floating_point()), tensors[0])

        def unsplit(hidden: torch.Tensor, extra: tuple) -> Any:
            return unflatten([*extra[:at], hidden, *extra[at:]])

        return leaves[at], unsplit, (*leaves[:at], *leaves[at + 1 :])

    def rebuild(self, hidden: torch.Tensor) -> Any:
        return self.unsplit(hidden, self.extra)

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
            if self.host_rngs is not None:
                stack.enter_context(self.host_rngs.replayed())
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            if self.tape is not None:
                stack.enter_context(self.tape.replay())
            yield

    def clear(self) -> None:
        self.args, self.kwargs, self.extra, self.saved, self.grad_inputs, self.changed = (), {}, (), None, [], None
        self.kept = self.tape = None
        self.row_spans, self.chunk_prints = [], []
        self.cpu_rng = self.dev_rng = None
        self.sinks = self.host_rngs = None


class SideOutputs:
    """Records, in call order, the floating-point tensors that may leave a block besides its hidden output:
    the outputs of submodules that carry forward hooks (what a hook can store), tensors assigned to a
    submodule attribute during the call, and the other elements of a tuple output. The recompute records
    the same list in the same order, so the i-th tensor of each belongs together."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.modules = list(block.modules())
        self.ids = {id(m) for m in self.modules}
        self.tensors: list[torch.Tensor] = []
        self.attrs: list[tuple[nn.Module, str, Any]] = []  # (module, name, value before the call)

    @contextmanager
    def recording(self) -> Iterator[SideOutputs]:
        # (C-level copies of the attribute dicts, as this runs per block call: what was rebound is looked at after)
        snapshots = [(m, m.__dict__.copy()) for m in self.modules]
        # The global hook records only modules that carry hooks of their own and run inside the call (the
        # block's own hooks fire around it): without any there is nothing to record, and no hook is
        # registered (submodule calls stay on nn.Module's fast path; a compiled block sees no global hook).
        hooked = any(m._forward_hooks for m in self.modules if m is not self.block)
        handle = nn.modules.module.register_module_forward_hook(self._hook) if hooked else None
        try:
            yield self
        finally:
            if handle is not None:
                handle.remove()
        for m, before in snapshots:
            for k, v in m.__dict__.items():
                was = before.get(k)
                if was is not v and isinstance(v, torch.Tensor) and v.is_floating_point():
                    self.tensors.append(v)
                    self.attrs.append((m, k, was if isinstance(was, torch.Tensor) else None))

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self.ids and module._forward_hooks:
            self.add(output)

    def add(self, tree: Any) -> None:
        leaves = torch.utils._pytree.tree_leaves(tree)
        self.tensors.extend(t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())

    def restore_attrs(self) -> None:
        """Put back the attribute values from before the call (a recompute overwrote what the forward stored)."""
        for module, name, value in self.attrs:
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value


def select_side(tensors: list[torch.Tensor], hidden: torch.Tensor, inputs: list[Any]) -> list[int]:
    """Indices of the recorded tensors to make outputs of the block's autograd node: each distinct tensor
    once, not the hidden output itself, not one of the block's own inputs (nothing was computed)."""
    seen = {id(hidden)} | {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    picked = []
    for i, t in enumerate(tensors):
        if id(t) not in seen:
            seen.add(id(t))
            picked.append(i)
    return picked


class _BlockFunction(torch.autograd.Function):
    """Autograd node of one streamed block. `anchor` requires grad so the block's weights get gradients
    even when its input does not (e.g. a frozen embedding feeding the first block). Its outputs are the
    hidden state and the block's side outputs (see :class:`SideOutputs`)."""

    @staticmethod
    def forward(ctx, runner: BlockRunner, state: CallState, anchor: torch.Tensor, hidden: torch.Tensor, *grad_inputs):
        # `grad_inputs`: the arguments that require grad (the block sees their stand-ins in `state`), then the
        # shared parameters it uses (outer parameters: autograd sums their gradients from every use)
        ctx.runner, ctx.state = runner, state
        engine = runner.engine
        if state.offload:
            state.saved = engine.saved_inputs.store(hidden, owner=state)  # nothing of it stays on the device
        elif not state.keep:  # (a kept graph holds the input itself)
            ctx.save_for_backward(hidden)
        ctx.set_materialize_grads(False)  # an unused side output sends None, not a tensor of zeros
        out, side = engine.forward_block(runner.idx, state, hidden, hidden.requires_grad)
        if state.tape is not None and state.offload:  # its attention outputs beside its input, on the host
            state.tape.stow(functools.partial(engine.saved_inputs.store, owner=state, beside=True))
        # A side output computed without grad (the forward ran in grad mode) needs none later either, as in
        # ordinary training: T5's cross-attention bias of zeros must not require grad in the next blocks.
        ctx.mark_non_differentiable(*(t for t in side if not t.requires_grad))
        # Each grad argument again, as the link of its InputChain (its gradient from the later blocks comes back
        # here). Not a shared parameter: each block's use of it reaches its leaf on its own, in the order
        # ordinary autograd accumulates a parameter's uses (the later block's first).
        return (out, *side, *(t.detach() for t in state.grad_inputs[: state.chained]))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, *grad_side: torch.Tensor | None):
        needs = tuple(ctx.needs_input_grad[3:])  # the hidden state's, then each grad input's
        engine, state = ctx.runner.engine, ctx.state
        if state.saved is not None:
            hidden = engine.saved_inputs.fetch(state.saved)
        else:  # (a kept graph holds its input itself)
            hidden = None if state.keep else ctx.saved_tensors[0]
        stowed = state.tape.bring(engine.saved_inputs.fetch) if state.tape is not None else []
        grads_in = engine.backward_block(ctx.runner.idx, state, hidden, [grad_out, *grad_side], needs)
        for saved in [state.saved, *stowed] if state.saved is not None else stowed:
            engine.saved_inputs.give_back(saved)
        state.clear()
        ctx.state = None
        return None, None, None, *grads_in


class BlockRunner:
    """Stands in for a decoder block's ``forward``; the block module itself stays in the model.

    `inner` is the forward the block had before (its class's, or one a library put on the instance)."""

    def __init__(self, engine: Streamer, idx: int, block: nn.Module, shared: list[nn.Parameter]) -> None:
        self.engine, self.idx = engine, idx
        self.shared = shared  # parameters the block shares with other blocks or the rest of the model
        self.own = block.__dict__.get("forward")  # an instance forward to put back on release
        self.modules = list(block.modules())  # (the block's generators are looked for among them per call)
        self.inner = self.own if self.own is not None else type(block).forward.__get__(block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        state = CallState(args, kwargs, engine.device, engine.preserve_rng_state)
        hidden = CallState.hidden_of(args, kwargs)
        if not torch.is_grad_enabled():
            # Evaluation: stream the weights, keep no input and build no graph. A KV cache is fine here.
            out, _ = engine.forward_block(self.idx, state, hidden, hidden.requires_grad, record=False)
            return state.rebuild(out)
        name = engine.units[self.idx].name
        _refuse_training_inputs(name, args, kwargs)
        if engine.preserve_rng_state:
            state.host_rngs = HostRngs(self.modules, args, kwargs)
        params = [p for p in self.shared if p.requires_grad]  # (frozen or not: checked at each call)
        originals = state.take_grad_inputs(params)
        user = (args[1:], {k: v for k, v in kwargs.items() if k != state.hidden_kw})
        state.sinks = Sinks.find(name, user, (state.args, state.kwargs))
        state.row_chunk = engine.chunks_call(self.idx, hidden)
        state.keep = state.row_chunk is None and engine.keeps_call(self.idx, hidden)
        state.offload = not state.keep and engine.offloads_call(self.idx, hidden)
        state.tape = None if state.keep else engine.attention_tape(self.idx)
        links = engine.input_chain.inputs(self.idx, originals)
        out, *side = _BlockFunction.apply(self, state, engine.grad_anchor, hidden, *links, *params)
        if originals:
            engine.input_chain.extend(self.idx, originals, side[-len(originals) :])
            side = side[: -len(originals)]
        # An input the block returned unchanged is returned as the caller's tensor, with its graph.
        passed = {
            id(s): o
            for s, o in zip([state.own_input, *state.grad_inputs[: state.chained]], [hidden, *originals])
            if s is not None
        }
        state.own_input = None
        state.extra = _replace(state.extra, state.extra_ids, side, passed)
        if state.sinks is not None:
            state.sinks.apply(
                lambda t: side[state.extra_ids[id(t)]] if id(t) in state.extra_ids else passed.get(id(t), t)
            )
        return state.rebuild(out)


class CompiledBlock:
    """A block's forward through ``torch.compile``: what :class:`BlockRunner` calls, in the forward and in
    the recompute, with ``compile_blocks=True``.

    All blocks of one class share one compiled function (the class's ``forward``, compiled once, the
    block passed as its ``self``), so 32 blocks compile once, not 32 times. Dynamo lifts a block's
    parameters into graph inputs and guards on their shapes, dtypes, strides and ``requires_grad``, not on
    their storage, so the engine re-pointing ``param.data`` at another slot between calls does not
    recompile. What does compile a new variant: grad mode (training's forward and recompute both run in it:
    one variant; evaluation without grad: another), train/eval, ``requires_grad`` flags (a frozen part: more
    for the blocks it touches) and each distinct input shape (``dynamic=False``: a new sequence length
    compiles once per grad mode). Dynamo allows ``torch._dynamo.config.recompile_limit`` (8) variants per
    class, after which the call raises; batches of one length stay at 1 (2 with validation).

    ``fullgraph=True``: a block that cannot be compiled as one graph fails at its first call, naming its
    class, rather than running partly eager. ``fallback_random``: dropout draws from torch's generator as
    eager code does, so the recompute, replaying the forward's RNG state, draws the forward's masks again.
    ``emulate_precision_casts``: fused kernels round intermediates to bf16 where eager code does, so bf16
    training follows eager bf16 training (tiny Llama, bf16-mixed, 3 steps: equal to eager; without it the
    updates differ by 8%, as much as bf16 from fp32).
    """

    def __init__(self, block: nn.Module, own: Callable[..., Any] | None, kept_attention: bool = False) -> None:
        self.name = type(block).__qualname__
        self.submodules = [(n, m) for n, m in block.named_modules() if m is not block]
        # With keep_attention each attention call runs eagerly between compiled pieces (engine/device/kept_attention.py):
        # the graph breaks there, and a break anywhere else is refused after the call that compiled it.
        self.breaks = kept_attention
        if own is None:
            self.fn = functools.partial(_shared_compiled(type(block).forward, not kept_attention), block)
        else:  # a forward a library put on this instance: compiled for this block alone
            self.fn = compiled(own, fullgraph=not kept_attention)
        self.calls = 0  # calls that went into the compiled function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_hooks()
        self.calls += 1
        breaks = dict(_graph_breaks()) if self.breaks else None
        try:
            out = self.fn(*args, **kwargs)
        except _compile_failures() as e:
            raise RuntimeError(self._failure(e)) from e
        if breaks is not None:
            other = [r for r, n in _graph_breaks().items() if n > breaks.get(r, 0) and KEPT_CALL not in r]
            if other:
                raise RuntimeError(self._failure(RuntimeError(other[0])))
        return out

    def _failure(self, e: BaseException) -> str:
        if type(e).__name__ == "FailOnRecompileLimitHit":
            limit = getattr(torch._dynamo.config, "recompile_limit", "?")
            return (
                f"compile_blocks=True: decoder block class {self.name} needs more compiled variants than "
                f"torch._dynamo.config.recompile_limit ({limit}) allows: each input shape, grad mode, train/eval "
                "mode and requires_grad pattern compiles one. Use batches of one fixed length, raise the limit, "
                "or pass MegatrainStrategy(compile_blocks=False)."
            )
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (
            f"compile_blocks=True: torch.compile could not compile decoder block class {self.name} as one graph "
            f"({type(e).__name__}: {reason}). Pass MegatrainStrategy(compile_blocks=False) to run it eagerly."
        )

    def _refuse_hooks(self) -> None:
        """Submodule hooks run inside the compiled call, where what they capture is neither recorded as a
        side output nor re-checked when hooks change; checked at every call (Hugging Face installs its output
        recorders at a model's first forward)."""
        hooked = [
            n
            for n, m in self.submodules
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        ]
        if hooked:
            names = ", ".join(hooked[:4]) + (", ..." if len(hooked) > 4 else "")
            raise RuntimeError(
                f"compile_blocks=True: submodules of decoder block class {self.name} carry hooks ({names}; e.g. "
                "Hugging Face's output recorders for output_router_logits or output_attentions), which a compiled "
                "block cannot record. Pass MegatrainStrategy(compile_blocks=False)."
            )


def compiled(fn: Callable[..., Any], fullgraph: bool = True) -> Callable[..., Any]:
    """`fn` through ``torch.compile`` with the options every compiled block call takes (see :class:`CompiledBlock`);
    `fullgraph` False only where the attention calls run eagerly (keep_attention)."""
    from torch._inductor import config as inductor

    casts = {"emulate_precision_casts": True} if hasattr(inductor, "emulate_precision_casts") else {}  # torch >= 2.6
    return torch.compile(fn, fullgraph=fullgraph, dynamic=False, options={"fallback_random": True, **casts})


@functools.cache
def _shared_compiled(forward: Callable[..., Any], fullgraph: bool) -> Callable[..., Any]:
    """One compiled function per block class's ``forward``, for every engine in the process."""
    return compiled(forward, fullgraph)


def _graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process, by reason."""
    return torch._dynamo.utils.counters["graph_break"]


def _compile_failures() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile a block: Dynamo's errors (a graph break under
    fullgraph, data-dependent control flow, an Inductor failure, an error of the block's own code met while
    tracing, whose message is kept) and, outside that hierarchy, its recompile limit."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException, *(e for e in [getattr(exc, "FailOnRecompileLimitHit", None)] if e is not None))


def compile_block_calls(blocks: list[nn.Module], runners: list[BlockRunner], kept_attention: bool = False) -> None:
    """Route each block's calls, forward and recompute, through ``torch.compile`` (:class:`CompiledBlock`)."""
    for block, runner in zip(blocks, runners):
        runner.inner = CompiledBlock(block, runner.own, kept_attention)


def _replace(leaves: tuple, ids: dict[int, int], side: list[torch.Tensor], passed: dict[int, torch.Tensor]) -> tuple:
    """The output's other leaves, each tensor that became output i of the autograd node replaced by that
    output, and each stand-in of an input by the input (`passed`)."""
    return tuple(
        (side[ids[id(t)]] if id(t) in ids else passed.get(id(t), t)) if isinstance(t, torch.Tensor) else t
        for t in leaves
    )


def is_cache(obj: Any) -> bool:
    """A Hugging Face KV cache object (any ``transformers.Cache`` subclass), recognized by class name so
    the engine needs no transformers import."""
    return any(cls.__name__ == "Cache" or cls.__name__.endswith("Cache") for cls in type(obj).__mro__[:-1])


def _refuse_training_inputs(block: str, args: tuple, kwargs: dict) -> None:
    """KV caches, and tensors that require grad inside objects the engine cannot take apart (their gradient
    would be lost silently)."""
    for name, value in [*((f"argument {i + 1}", a) for i, a in enumerate(args[1:])), *kwargs.items()]:
        for leaf in flatten(value)[0]:
            if isinstance(leaf, (torch.Tensor, nn.Module, type)) or not hasattr(leaf, "__dict__"):
                continue
            inside = [k for k, v in vars(leaf).items() if isinstance(v, torch.Tensor) and v.requires_grad]
            if inside and not is_cache(leaf):
                raise TypeError(
                    f"strategy='megatrain': block {block} got a {type(leaf).__name__} (in {name}) holding a "
                    f"tensor that requires grad ({inside[0]!r}), which would get no gradient: pass the tensor as an "
                    "argument of its own, or in a tuple, list, dict or dataclass"
                )
        if is_cache(value):
            raise RuntimeError(
                f"strategy='megatrain': block {block} got a KV cache ({type(value).__name__}, as {name}) while "
                "training. Each block is recomputed in backward, which would fill the cache a second time and give "
                "wrong gradients. Call the model with use_cache=False in training_step (the strategy already sets "
                "config.use_cache=False on the model's configs during fit), and pass no past_key_values/cache."
            )
