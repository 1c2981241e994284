"""Block inputs saved for backward in pinned host memory instead of on the device (long context).

Without offloading, every block keeps its input hidden state on the device until its backward: one
``[tokens, hidden]`` tensor per block, the only device memory that grows with depth (256 KiB per token
for an 8B model in bf16). With ``offload_inputs``, each block's input is copied to a pinned host buffer on
the D2H stream right after the block's forward is enqueued, and copied back on the H2D stream one block
ahead in backward::

    compute | fwd i | fwd i+1 |   ...   | bwd i+1 (recompute)   | bwd i
    D2H     |       | x_i -> host | x_i+1 -> host
    H2D     |                               | x_i -> device (prefetch) |

Each call of a block gets its own host buffer (from a pool of exact-size buffers reused across steps),
so two forwards before one backward are as correct as one. A buffer returns to the pool when its block's
backward has run; the next copy into it waits for the upload that read it.

``offload_inputs="auto"`` (the default) decides at the first block of each forward pass, from the size of
what the pass would save and the device memory free for it (:func:`offload_needed`). Every block of the
pass follows that decision: each call records where its input went, and its backward looks there.

``offload_inputs_dtype`` stores the inputs in a smaller form (engine/device/input_codec.py): encoded on the compute
stream before the D2H copy, decoded on the compute stream after the H2D copy; the buffers, the pool and the
events below see only the stored form. It does nothing to inputs kept on the device.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_lightning.engine.config import OffloadInputs, OffloadInputsDtype, check_offload_inputs
from megatrain_lightning.engine.device.input_codec import InputCodec
from megatrain_lightning.engine.device.streams import Streams
from megatrain_lightning.engine.host.pinned import host_empty
from megatrain_lightning.engine.host.units import HostMemoryError

log = logging.getLogger("megatrain_lightning")


def offload_needed(saved_bytes: int, free_bytes: int) -> bool:
    """The "auto" rule: offload a forward pass's saved block inputs when they would take more than half of
    the device memory free for them.

    `saved_bytes` is what the pass would keep on the device (blocks x one block's input), `free_bytes` the
    device memory free now, the allocator's cached but unused memory included (see device_memory.py).
    The other half is the reserve for everything else the step needs on top of the saved inputs: one
    block's recompute with grad (several hidden states' worth of activations), the loss and its logits, and
    the allocator's fragmentation. Offloading costs one copy of each input each way, which the copy
    streams mostly hide; running out of memory ends the run, so the rule errs towards offloading.
    """
    return saved_bytes > free_bytes // 2


@dataclass
class SavedInput:
    """One block call's input on the host, and its way back to the device."""

    host: torch.Tensor  # flat pinned buffer, the input in its stored form (InputCodec)
    shape: torch.Size
    dtype: torch.dtype  # the input's own dtype, which backward gets back
    stored: Any  # event: the D2H copy into `host` finished
    device: torch.Tensor | None = None  # the stored form back on the device (after prefetch)
    loaded: Any = None  # event: the H2D copy into `device` finished
    returned: bool = False  # the host buffer is back in the pool


class SavedInputs:
    """A pool of exact-size pinned host buffers holding block inputs between forward and backward."""

    def __init__(
        self,
        streams: Streams,
        device: torch.device,
        pin: bool,
        stats: dict,
        mode: OffloadInputs = "auto",
        free_bytes: Callable[[], int | None] = lambda: None,
        host_available: Callable[[], int] | None = None,
        stored_dtype: OffloadInputsDtype = None,
        kept_attention: bool = False,
    ) -> None:
        self.streams, self.device, self.pin, self.stats = streams, device, pin, stats
        self.mode = check_offload_inputs(mode)
        self.codec = InputCodec(stored_dtype)
        self.free_bytes = free_bytes  # device memory free for saved inputs; None where "auto" keeps them there
        self.host_available = host_available  # host memory the OS can still hand out; None: unchecked
        # keep_attention: each call's attention outputs are saved beside its input, as many bytes again (the width
        # of attention's output is the hidden size in the decoders this targets; the log-sum-exp adds 4 bytes a head)
        self.per_input = 2 if kept_attention else 1
        self._pass_offloads: bool | None = None  # the decision of the forward pass under way
        self._announced = False
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self.buffers: list[torch.Tensor] = []  # every buffer allocated (host bytes, teardown)
        self.largest = 0  # bytes of the largest input stored so far (what a step's transient held beside it)

    def offloads_call(self, idx: int, hidden: torch.Tensor, num_blocks: int) -> bool:
        """Whether this call of block `idx` (under grad) saves its input on the host.

        Decided when block 0 starts a forward pass and then followed by every block of the pass, so free
        memory that changes midway cannot split a pass. Each call keeps its answer (CallState.offload,
        CallState.saved): its backward looks where its forward put the input."""
        if idx == 0 or self._pass_offloads is None:
            self._pass_offloads = self._decide(hidden, num_blocks)
            if self._pass_offloads:
                self._check_host_memory(hidden, num_blocks - idx)
            self.stats["offloaded_passes"] += int(self._pass_offloads)
        return self._pass_offloads

    def _check_host_memory(self, hidden: torch.Tensor, calls: int) -> None:
        """Refuse, before pinning any of them, the host buffers this pass's `calls` block inputs would add.

        The engine's check at construction cannot count them: it does not know the sequence length and
        batch the run will feed (the planner does, and counts them as "activations"). Here the first
        offloading pass of each input shape has the exact bytes; buffers back in the pool are reused, so a
        pass that needs no new buffers (every later step) reads nothing."""
        numel, dtype = self.codec.stored(hidden)
        pooled = len(self._free.get((numel, dtype), []))
        need = max(0, calls - pooled) * numel * dtype.itemsize * self.per_input
        if need == 0 or self.host_available is None:
            return
        have = self.host_available()
        if need > have:
            raise HostMemoryError(
                f"offload_inputs pins {calls} block inputs of shape {tuple(hidden.shape)} "
                f"({str(hidden.dtype).removeprefix('torch.')}{self._stored_as()}): {need} bytes "
                f"({need / 2**30:.2f} GiB) more host memory, but about {have / 2**30:.2f} GiB is available. Shorten "
                "seq_len or the micro-batch, set offload_inputs=False (the inputs stay on the device), store them "
                "smaller (offload_inputs_dtype='fp8', lossy), or use a machine with more host memory; "
                "`megatrain plan --offload-inputs` sizes a run first"
            )

    def _decide(self, hidden: torch.Tensor, num_blocks: int) -> bool:
        if self.mode != "auto":
            return self.mode
        free = self.free_bytes()
        if free is None:
            return False
        saved = num_blocks * hidden.numel() * hidden.element_size() * self.per_input
        offload = offload_needed(saved, free)
        if offload and not self._announced:
            self._announced = True  # once per run: the decision may flip with every step
            log.info(
                "offload_inputs='auto': saving block inputs in host memory: %d blocks x %s need %.2f GiB, "
                "%.2f GiB of device memory free",
                num_blocks,
                tuple(hidden.shape),
                saved / 2**30,
                free / 2**30,
            )
        return offload

    def _stored_as(self) -> str:
        return "" if self.codec.dtype is None else f", stored as {self.codec.dtype}"

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def store(self, hidden: torch.Tensor, owner: object, beside: bool = False) -> SavedInput:
        """Start copying `hidden` (just produced on the compute stream) to a host buffer, held until
        :meth:`give_back` or until `owner` (the block call's state) is garbage: a graph dropped without
        backward (a skipped step) must not keep its buffers from the pool. `beside`: not a block's input but a
        tensor kept beside it (keep_attention), which :attr:`largest` does not count."""
        s = self.streams
        buf, last_read = self._take(*self.codec.stored(hidden))
        s.wait(s.d2h, last_read)  # the upload of the buffer's previous content has read it
        src = self.codec.encode(hidden)  # on the compute stream; None: a view of `hidden`
        s.wait(s.d2h, s.event())  # the compute producing `hidden` (and encoding it)
        s.copy(s.d2h, buf, src)
        if s.is_cuda:
            src.record_stream(s.d2h)  # the device tensor is freed after forward; the copy still reads it
        self.stats["input_offload_bytes"] += buf.nbytes
        self.largest = self.largest if beside else max(self.largest, buf.nbytes)
        saved = SavedInput(buf, hidden.shape, hidden.dtype, stored=s.event(s.d2h))
        weakref.finalize(owner, self.give_back, saved)
        return saved

    def prefetch(self, saved: SavedInput | None, early: bool = False) -> None:
        """Start copying a saved input back to the device (no-op if already on its way). `early`: before the
        compute of the backward that precedes its own (where there is room for it beside that backward's), so
        the copy runs during that backward rather than after it, where its own backward would wait for it."""
        if saved is None or saved.device is not None:
            return
        self.stats["early_input_fetches"] += int(early)
        s = self.streams
        saved.device = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=self.device)
        s.wait(s.h2d, saved.stored)
        s.wait(s.h2d, s.event())  # the device memory may have just been freed by compute still in flight
        s.copy(s.h2d, saved.device, saved.host)
        if s.is_cuda:
            # Allocated on the compute stream, written on the H2D stream: a prefetched input never fetched (a
            # partial autograd.grad, an exception) is freed by the compute stream's order alone, and its memory
            # could be handed out again while the copy still writes it.
            saved.device.record_stream(s.h2d)
        saved.loaded = s.event(s.h2d)
        self.stats["input_offload_bytes"] += saved.host.nbytes

    def fetch(self, saved: SavedInput) -> torch.Tensor:
        """The saved input on the device, safe to read on the compute stream (decoded there)."""
        self.prefetch(saved)
        self.streams.wait(None, saved.loaded)
        return self.codec.decode(saved.device, saved.shape, saved.dtype)

    def give_back(self, saved: SavedInput) -> None:
        """The block's backward is done with the input: its host buffer can hold another."""
        if saved.returned:
            return
        saved.returned = True
        key = (saved.host.numel(), saved.host.dtype)
        self._free.setdefault(key, []).append((saved.host, saved.loaded))
        saved.device = None

    def _take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        self.buffers.append(host_empty(numel, dtype, self.pin))
        return self.buffers[-1], None
