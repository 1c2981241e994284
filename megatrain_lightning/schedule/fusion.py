"""What ``compile_blocks=True`` does to a block's memory-bound GPU work, measured from inductor itself.

The recording (record.py) logs a block's kernels as eager PyTorch issues them: RMSNorm, RoPE, SiLU and the gate
product, the residual adds and the casts under autocast each move their operands through device memory. With
``compile_blocks`` the engine runs each block's forward, and its recompute, through ``torch.compile``
(engine/device/block_fn.py): inductor fuses that elementwise work into fewer kernels that move fewer bytes,
while matmuls and attention stay the library kernels they were (inductor's extern kernels).

:func:`block_fusion` measures, for one decoder block of a config, the bytes its memory-bound kernels move,
eager and compiled, in each of the two graphs a compiled block runs: the forward (the training graph, which also
writes what its backward saves; the engine's forward and recompute both run it) and the backward. Eager: the ops
the block dispatches, counted as the recorder counts them (:func:`record.kernel_bytes`). Compiled: inductor's
scheduler after fusion, each kernel's buffers read and written (``get_read_write_buffers_sizes``, inductor's own
estimate), with the engine's compile options. Each at two sequence lengths, so that what does not grow with the
tokens (the norms' weights) drops out: the ratio is of the bytes per token. The recorder then scales each
memory-bound kernel of a block's forward code, and of its autograd backward, by its graph's ratio; the engine's
own kernels between them (no compiled graph holds them) keep their bytes, and so does every kernel's launch on
the issuing thread (the compiled graphs launch fewer: the issuing thread's figure is an upper bound).

Inductor runs on the CPU here: there is no GPU, and its GPU code generator needs Triton. Its CPU backend's fusion
stands in for the GPU's (one scheduler, fusing by the same rules of shared loops and buffers); the figures are
inductor's estimate of what its kernels move, to be checked against a GPU's profile. The model is the project's
Llama block (models/llama.py), untiled (a tiled block runs other code: refused by the caller).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_lightning.engine.config import compute_dtype
from megatrain_lightning.engine.device.block_fn import compiled
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.models.llama import DecoderLayer, RotaryEmbedding
from megatrain_lightning.schedule.record import kernel_bytes
from megatrain_lightning.schedule.report import gpu_kind

LENGTHS = (64, 128)  # tokens of the two measured calls (one row each)
GRAPHS = ("forward", "backward")


@dataclass(frozen=True)
class Fusion:
    """Per graph of a compiled block: its memory-bound bytes per token against eager code's, and its
    memory-bound kernels per call, eager and compiled."""

    forward: float
    backward: float
    eager_kernels: tuple[int, int]  # forward, backward
    fused_kernels: tuple[int, int]
    measure_s: float  # seconds the measurement took here

    def ratio(self, graph: str) -> float:
        return self.forward if graph == "forward" else self.backward

    def describe(self) -> str:
        return (
            f"compile_blocks: the block's memory-bound bytes x {self.forward:.3f} in its forward, "
            f"x {self.backward:.3f} in its backward ({self.eager_kernels[0]} -> {self.fused_kernels[0]} and "
            f"{self.eager_kernels[1]} -> {self.fused_kernels[1]} kernels; inductor's fusion on the CPU, "
            f"measured in {self.measure_s:.0f} s)"
        )


_MEASURED: dict[str, Fusion] = {}


def block_fusion(config: LlamaConfig, precision: str = "bf16-mixed") -> Fusion:
    """The :class:`Fusion` of one decoder block of `config` trained in `precision` (measured once per process)."""
    shape = dataclasses.replace(config, num_hidden_layers=1)
    key = f"{shape!r} {precision}"
    if key not in _MEASURED:
        _MEASURED[key] = _measure(shape, precision)
    return _MEASURED[key]


def _measure(config: LlamaConfig, precision: str) -> Fusion:
    t0 = time.perf_counter()
    dtype = compute_dtype(precision)
    autocast = dtype if precision.endswith("-mixed") else None
    eager, fused = [], []
    for tokens in LENGTHS:
        block, x, cos, sin, grad = block_call(config, tokens, dtype)
        eager.append(_eager(block, autocast, x, cos, sin, grad))
        fused.append(_compiled(block, autocast, x, cos, sin, grad))
    ratios = []
    for g in range(len(GRAPHS)):
        per_token = [(run[1][g][1] - run[0][g][1]) for run in (eager, fused)]
        if per_token[0] <= 0:
            raise RuntimeError(
                f"compile_blocks model: the block's eager {GRAPHS[g]} moves no more bytes at more tokens"
            )
        ratios.append(per_token[1] / per_token[0])
    return Fusion(
        forward=ratios[0],
        backward=ratios[1],
        eager_kernels=(eager[1][0][0], eager[1][1][0]),
        fused_kernels=(fused[1][0][0], fused[1][1][0]),
        measure_s=time.perf_counter() - t0,
    )


def block_call(config: LlamaConfig, tokens: int, dtype: torch.dtype, device: str = "cpu") -> tuple:
    """One decoder block of `config` in `dtype` (seeded weights) and what a call of it over one row of `tokens`
    takes: (block, hidden input requiring grad, cos, sin, a gradient of its output)."""
    torch.manual_seed(0)
    block = DecoderLayer(config).to(device, dtype)
    cos, sin = (t.to(device) for t in RotaryEmbedding(config)(torch.arange(tokens).unsqueeze(0), dtype))
    x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    return block, x, cos, sin, torch.randn_like(x)


def _autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype, cache_enabled=False, enabled=dtype is not None)


def _eager(block: torch.nn.Module, autocast, x, cos, sin, grad) -> list[tuple[int, int]]:
    """(memory-bound kernels, bytes) of the block's eager forward and backward."""
    counts = []
    params = list(block.parameters())
    with _autocast(autocast), _EagerBytes() as forward:
        out = block(x, cos, sin)
    counts.append(forward.total)
    with _EagerBytes() as backward:
        torch.autograd.grad(out, [x, *params], grad)
    counts.append(backward.total)
    return counts


def _compiled(block: torch.nn.Module, autocast, x, cos, sin, grad) -> list[tuple[int, int]]:
    """(memory-bound kernels, bytes) of the compiled block's forward and backward graphs, from inductor's
    scheduler (a compile of its own: inductor's caches are off, so the scheduler runs)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    params = list(block.parameters())

    def call(module: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
        return type(module).forward(module, *args)

    fn = compiled(call)
    with (
        inductor_config.patch(fx_graph_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
        _scheduled() as graphs,
    ):
        with _autocast(autocast):
            out = fn(block, x, cos, sin)
        torch.autograd.grad(out, [x, *params], grad)
    if len(graphs) != len(GRAPHS):
        raise RuntimeError(
            f"compile_blocks model: inductor compiled {len(graphs)} graphs for one block, not a forward and a backward"
        )
    return graphs


class _EagerBytes(TorchDispatchMode):
    """Counts the memory-bound kernels of what runs under it, and their bytes, as the recorder would."""

    def __enter__(self) -> _EagerBytes:
        self.total = (0, 0)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        nbytes = kernel_bytes(func, args, kwargs, out)
        if nbytes is not None and gpu_kind(func._overloadpacket.__name__) == "memory-bound":
            self.total = (self.total[0] + 1, self.total[1] + nbytes)
        return out


@contextmanager
def _scheduled() -> Iterator[list[tuple[int, int]]]:
    """Per graph inductor compiles meanwhile, (memory-bound kernels, bytes) after its fusion: its fused and
    pointwise kernels and any extern kernel that is neither a matmul nor attention."""
    from torch._inductor import scheduler as sched

    graphs: list[tuple[int, int]] = []
    codegen = sched.Scheduler.codegen

    def counting(self) -> None:
        kernels = nbytes = 0
        for node in self.nodes:
            if isinstance(node, sched.NopKernelSchedulerNode):
                continue
            if isinstance(node, sched.ExternKernelSchedulerNode):
                name = getattr(node.node, "python_kernel_name", None)
                if name is None:  # (MultiOutput: a tuple's element, no kernel)
                    continue
                op = name.removesuffix(".default").rsplit(".", 1)[-1]
                if gpu_kind(op) != "memory-bound":
                    continue
            kernels += 1
            nbytes += node.get_read_write_buffers_sizes()
        graphs.append((kernels, nbytes))
        return codegen(self)

    sched.Scheduler.codegen = counting
    try:
        yield graphs
    finally:
        sched.Scheduler.codegen = codegen
