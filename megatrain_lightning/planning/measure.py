"""The device memory of one training step, measured by running the engine and model on fake tensors.

``measure_step(config, seq_len)`` runs one real step of :class:`~megatrain_lightning.Engine` with
:class:`LlamaForCausalLM` (forward with the chunked loss, backward, the host worker's flush) under
``FakeTensorMode``: every tensor has a shape, a dtype and a storage size but no memory, so an 8B model
at 128k tokens takes seconds and no RAM. It checks the planner's formulas against the code that runs.

What is counted (like ``torch.cuda.max_memory_allocated``, not the CUDA context):

- Device bytes are counted by a dispatch mode entered inside the fake mode. Each storage an op
  produces that none of its inputs already had (views and in-place results are not allocations) adds
  its bytes to the live total once, and a ``weakref.finalize`` on the storage takes them off when it is
  freed; the peak is the largest live total.
- The "device" is the fake CPU: on the CPU-only wheel autograd refuses fake CUDA tensors, and the
  engine swaps ``param.data`` between host and device tensors, which torch refuses between cpu and
  meta. So host buffers must be told apart: every host buffer the engine owns comes from
  ``engine.host.pinned.host_empty``, whose observers (``host_observers``) report it, and its bytes are taken
  off again (and the peak is restored to what it was before that allocation).
- Dispatch modes are thread-local, so what the engine's host worker thread computes is not counted,
  which is right: it works on host memory.
- With ``recompute`` other than True and a ``capacity``, the engine reads as free device memory the
  capacity less the live bytes counted, so ``recompute="auto"`` keeps as many graphs as it would on a GPU
  of that size; its first step recomputes every block and measures their activations, so two steps run
  and the second is measured (``Measured.kept_calls``: the block calls that kept their graph in it).
- The model is built before counting starts (its own parameters are host memory and are released
  into the engine's flat host buffers); the engine is constructed while counting, so the weight slots,
  gradient slots and outer parameters it puts on the device make up ``persistent``.

Kernel workspace the fake kernels do not show: on CUDA, bf16 attention runs the flash kernel, whose
backward allocates internally, besides its outputs dq, dk, dv,

- an fp32 dq accumulator [B, T rounded up to 128, heads, head_dim rounded up to 32],
- fp32 softmax row sums [B, heads, T rounded up to 128],
- with grouped-query attention (k, v with fewer heads than q), dk and dv expanded to every query head
  [B, T, heads, head_dim] in the compute dtype, summed into the real dk, dv afterwards.

On the CPU the model's attention runs ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
``_backward`` (same arguments). When the counter sees that backward, the workspace the CUDA kernel
would hold is added on top of the live bytes (its outputs included) for the duration of the op:
``peak = max(peak, live + workspace)``, and ``Measured.workspace`` reports the largest such amount.
In fp32 CUDA runs the memory-efficient kernel, which accumulates straight into its fp32 outputs: no
workspace is modelled. The flash forward allocates nothing beyond its outputs.

The tiled attention core (models/tiled_attention.py) is two operators, ``megatrain.tiled_attention`` and its
``_backward``, whose fake versions only make their outputs; what the real ones hold inside (one block pair,
and in backward the rows' D) is added the same way, in either dtype, as ``tiled_attention.workspace_bytes``
models it.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_lightning.engine.config import EngineConfig, compute_dtype
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.host import pinned
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.models.tiled_attention import workspace_bytes

_FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward"
_TILED = "megatrain.tiled_attention"


@dataclass(frozen=True)
class Measured:
    """Device bytes of one training step (allocator bytes, without the CUDA context)."""

    peak: int  # max over the step (forward, backward and flush)
    persistent: int  # held after engine construction: weight slots, gradient slots, outer parameters
    forward_peak: int
    backward_peak: int
    workspace: int  # modelled kernel workspace included in the peak (module docstring)
    seconds: float  # wall time of the measurement
    kept_calls: int = 0  # block calls of the measured step that kept their graph (recompute)


def measure_step(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int = 1,
    precision: str = "bf16-mixed",
    num_slots: int = 2,
    offload_inputs: bool = False,
    recompute: bool | str = True,
    capacity: int | None = None,
    grad_sums: int = 0,
    row_chunk: int | None = None,
) -> Measured:
    """Run one training step of `config` on fake tensors and measure its device memory; with `recompute`
    other than True and the device bytes the engine may take (`capacity`), the step after a first one,
    when kept graphs are decided (module docstring). `grad_sums`: that many blocks keep their gradient sums
    on the device (``device_grad_sums``), so the measured backward is an accumulating micro-batch's.
    `row_chunk`: block calls of that many rows at a time (engine/device/rows.py)."""
    if getattr(config, "token_chunk_size", None) == "auto":
        # "auto" sizes tiles from free CUDA memory; on the fake CPU it would pick the CPU's fixed tile.
        raise ValueError("token_chunk_size='auto' depends on the GPU's free memory; measure a fixed tile size")
    dtype = compute_dtype(precision)  # ValueError naming a bad precision
    t0 = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = LlamaForCausalLM(config)  # host memory: built before counting starts
        counter = DeviceBytes(kernel_workspace if dtype == torch.bfloat16 else tiled_workspace)
        with counter, observe_host_allocations(counter.host_buffer):
            options = EngineConfig(
                device="cpu",
                precision=precision,
                num_slots=num_slots,
                offload_inputs=offload_inputs,
                pin_memory=False,
                recompute=recompute,
                device_grad_sums=grad_sums,
                row_chunk=row_chunk,
            )
            free = None if capacity is None else (lambda: capacity - counter.live)
            engine = Engine(model, options, Probes(host_available_bytes=lambda: 1 << 62, device_free_bytes=free))
            try:
                persistent = counter.live
                forward, backward = _step(model, engine, counter, micro_batch, seq_len, grad_sums > 0)
                kept = engine.stats["kept_calls"]
                if recompute is not True and capacity is not None:  # the first step measured, this one keeps
                    engine.zero_grad()  # a fresh step, not an accumulation into the first one's gradients
                    forward, backward = _step(model, engine, counter, micro_batch, seq_len, grad_sums > 0)
                    kept = engine.stats["kept_calls"] - kept
            finally:
                release_quietly(engine)
    return Measured(
        peak=max(forward, backward),
        persistent=persistent,
        forward_peak=forward,
        backward_peak=backward,
        workspace=counter.workspace,
        seconds=time.perf_counter() - t0,
        kept_calls=kept,
    )


def _step(
    model: LlamaForCausalLM, engine: Engine, counter: DeviceBytes, micro_batch: int, seq_len: int, accumulate: bool
) -> tuple[int, int]:
    """(forward peak, backward peak) of one step (`accumulate`: of a micro-batch that more follow, whose block
    gradients may be summed on the device); the batch lives on the device, as in training."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.int64)
    counter.reset_peak()
    loss = model(ids, targets=ids)
    forward = counter.reset_peak()
    with engine.backward(accumulate=accumulate):
        loss.backward()
    engine.flush()
    return forward, counter.reset_peak()


def release_quietly(engine: Engine) -> None:
    # Stops the host worker thread. Unregistering pinned buffers asks the fake tensors for a data pointer
    # (none were pinned here), which only warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine.close()


@contextmanager
def observe_host_allocations(callback: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `callback` with every host buffer the engine allocates (``host_empty``) meanwhile."""
    pinned.host_observers.append(callback)
    try:
        yield
    finally:
        pinned.host_observers.remove(callback)


def kernel_workspace(func: Any, args: tuple) -> int:
    """What the attention kernels of a bf16 run hold beyond their outputs (the flash backward's or the tiled
    core's); 0 for any other op."""
    return flash_workspace(func, args) + tiled_workspace(func, args)


def tiled_workspace(func: Any, args: tuple) -> int:
    """Bytes the tiled attention core's forward (q, k, v, ...) or backward (dout, q, k, v, ..., block, ...)
    holds inside beyond its outputs (module docstring); 0 for any other op."""
    name = str(func)
    if not name.startswith(_TILED):
        return 0
    backward = name.startswith(_TILED + "_backward")
    q, k = args[1:3] if backward else args[0:2]
    block = args[7] if backward else args[4]
    b, heads, t, d = q.shape
    return workspace_bytes(b, heads, k.shape[1], t, d, block, backward)


def flash_workspace(func: Any, args: tuple) -> int:
    """Bytes the CUDA flash-attention backward allocates beyond its outputs, for the CPU flash backward's
    arguments (grad_out, query, key, value, ...; [B, heads, T, head_dim]); 0 for any other op."""
    if not str(func).startswith(_FLASH_BACKWARD):
        return 0
    query, key = args[1], args[2]
    b, heads, t, d = query.shape
    t_rounded, d_rounded = _round_up(t, 128), _round_up(d, 32)
    dq_accum = b * t_rounded * heads * d_rounded * 4
    softmax_d = b * heads * t_rounded * 4
    expanded = 2 * b * key.shape[2] * heads * d * key.element_size() if key.shape[1] < heads else 0
    return dq_accum + softmax_d + expanded


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class DeviceBytes(TorchDispatchMode):
    """Live and peak bytes of the storages created by ops on this thread (module docstring).

    `workspace_of(func, args)` names bytes an op holds internally while it runs, beyond its outputs; while
    `skip()` is true ops are not counted (the schedule model's host jobs, run on the issuing thread)."""

    def __init__(
        self, workspace_of: Callable[[Any, tuple], int] | None = None, skip: Callable[[], bool] = lambda: False
    ) -> None:
        super().__init__()
        self.workspace_of, self.skip = workspace_of, skip
        self.live = 0
        self.peak = 0
        self.workspace = 0  # the largest workspace added
        self._sizes: dict[int, int] = {}  # storage key -> bytes, for storages counted and alive
        self._last: tuple[int, set[int]] = (0, set())  # (peak before the last op, storages it created)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = tensors_in(out)
        if not outputs or self.skip():
            return out  # most ops by count are prim.device queries
        known = {storage_key(t) for t in tensors_in((args, kwargs))}
        created = {}
        for t in outputs:
            key = storage_key(t)
            if key not in known and key not in self._sizes:
                created[key] = t.untyped_storage()
        self._last = (self.peak, set(created))
        for key, storage in created.items():
            self._add(key, storage)
        self.peak = max(self.peak, self.live)
        extra = self.workspace_of(func, args) if self.workspace_of is not None else 0
        if extra:
            self.peak = max(self.peak, self.live + extra)
            self.workspace = max(self.workspace, extra)
        return out

    def _add(self, key: int, storage: torch.UntypedStorage) -> None:
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        weakref.finalize(storage, self._free, key).atexit = False

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def host_buffer(self, t: torch.Tensor) -> None:
        """`t` is host memory: uncount it. Its allocation was the last op (``host_empty``), so the peak is
        what it would have been without it."""
        key = storage_key(t)
        if key not in self._sizes:
            return  # allocated on another thread (the host worker): never counted
        self._free(key)
        before, created = self._last
        if key in created:
            self.peak = max(before, self.live)

    def reset_peak(self) -> int:
        """The peak so far; the next one starts from the bytes live now."""
        peak, self.peak = self.peak, self.live
        return peak


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (all an op's arguments and results hold)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
