"""Exact-size page-locked host memory: ordinary host tensors registered with CUDA.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every
allocation up to a power of two (pytorch/pytorch#95823): a 218M-parameter bf16 block copy asks for
416 MiB and gets 512 MiB, about 6 GiB more for an 8B model in bf16 and 12 GiB in fp32, none of it
counted. Here a buffer is allocated at its exact size as ordinary (pageable) memory and page-locked in
place with ``cudaHostRegister``, so the pinned bytes are exactly the bytes the engine accounts.

A registered tensor is held in a registry until it is unregistered: freeing page-locked memory while
it is still registered (and letting the allocator hand the pages out again) must not happen. The
engine unregisters its own buffers in ``Engine.close()``; afterwards they are ordinary host
memory (the fp32 masters live on as the model's parameters).

The CUDA calls sit in :func:`_host_register`, :func:`_host_unregister` and :func:`_clear_last_error`
only, so tests replace them on machines without a GPU. A failed runtime call leaves its error behind as
CUDA's "last error", which the next kernel launch's check (torch's) reads and raises as its own: every
failure here is cleared at once, so that the documented retry with ``pin_memory=False`` runs.

Every host buffer the engine owns, pinned or not, comes from :func:`host_empty` at the end of this file.
"""

from __future__ import annotations

import ctypes
import resource
import threading
import warnings
from collections.abc import Callable

import torch

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current device's."""


class PinnedMemoryError(RuntimeError):
    """Host memory could not be page-locked (usually the locked-memory limit, ``ulimit -l``)."""


_lock = threading.Lock()
_registry: dict[int, torch.Tensor] = {}  # data_ptr -> the registered tensor (kept alive while registered)


def _host_register(ptr: int, nbytes: int, flags: int) -> int:
    """``cudaHostRegister``; returns the CUDA error code (0 on success)."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))


def _host_unregister(ptr: int) -> int:
    """``cudaHostUnregister``; returns the CUDA error code (0 on success)."""
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _clear_last_error() -> None:
    """``cudaGetLastError``, which returns and resets the error the last failed runtime call left behind
    (torch binds no such call: it is found in the CUDA runtime library the process has loaded)."""
    fn = _cuda_get_last_error()
    if fn is not None:
        fn()


_get_last_error: list[Callable[[], int] | None] = []  # looked up once


def _cuda_get_last_error() -> Callable[[], int] | None:
    if not _get_last_error:
        _get_last_error.append(_find_cuda_symbol("cudaGetLastError"))
    return _get_last_error[0]


def _find_cuda_symbol(name: str) -> Callable[[], int] | None:
    """`name` from the CUDA runtime this process loaded (torch's), or None where none is loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        paths = set()
    for path in sorted(paths) + [None]:  # None: the symbols the process itself exports
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    warnings.warn(
        f"{name} was not found in a loaded CUDA runtime: a failed pinning's error is not cleared", stacklevel=2
    )
    return None


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor of exactly ``numel`` elements, page-locked for asynchronous copies."""
    t = torch.empty(numel, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t  # nothing to lock (CUDA refuses empty ranges)
    try:
        code = _host_register(t.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
    except (AssertionError, RuntimeError) as e:  # torch without CUDA, no GPU visible
        raise PinnedMemoryError(f"pinned host memory needs a CUDA GPU ({e}); pass pin_memory=False") from e
    if code != 0:
        _clear_last_error()
        raise PinnedMemoryError(
            f"could not page-lock {nbytes / 2**20:.1f} MiB of host memory ({nbytes} bytes) for transfers to the "
            f"GPU: cudaHostRegister returned {_error_name(code)}, with {registered_bytes() / 2**30:.2f} GiB already "
            f"pinned by this process and a locked-memory limit (RLIMIT_MEMLOCK) of {_memlock_limit()}. Raise the "
            "limit (`ulimit -l unlimited`, memlock in /etc/security/limits.conf, or `docker run --ulimit "
            "memlock=-1`), free host memory, or pass EngineConfig(pin_memory=False) (slower, synchronous copies)."
        )
    with _lock:
        _registry[t.data_ptr()] = t
    return t


def is_registered(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is (the start of) a buffer registered here."""
    if t is None or t.numel() == 0:
        return False
    with _lock:
        return _registry.get(t.data_ptr()) is not None


def registered_bytes(tensors: list[torch.Tensor | None] | None = None) -> int:
    """Pinned bytes held through this module: all of them, or those of ``tensors`` (each buffer once)."""
    with _lock:
        if tensors is None:
            held = list(_registry.values())
        else:
            found = {t.data_ptr(): _registry.get(t.data_ptr()) for t in tensors if t is not None and t.numel()}
            held = [r for r in found.values() if r is not None]
    return sum(r.numel() * r.element_size() for r in held)


def unregister(tensors: list[torch.Tensor | None]) -> int:
    """Unregister each registered buffer among ``tensors`` (others are skipped); returns the bytes unlocked.

    The caller makes sure no copy still reads or writes them. A buffer CUDA refuses to unregister stays
    in the registry (and so is never freed while locked), with a warning.
    """
    done = 0
    for t in tensors:
        if not is_registered(t):
            continue
        assert t is not None
        ptr = t.data_ptr()
        code = _host_unregister(ptr)
        with _lock:
            if code == 0:
                held = _registry.pop(ptr)
                done += held.numel() * held.element_size()
        if code != 0:
            _clear_last_error()
            warnings.warn(
                f"cudaHostUnregister of a pinned host buffer at {ptr:#x} returned {_error_name(code)}; "
                "it stays allocated",
                stacklevel=2,
            )
    return done


def unregister_all() -> int:
    """Unregister every buffer this module registered (for teardown of a whole process or test)."""
    with _lock:
        held = list(_registry.values())
    return unregister(held)


def _error_name(code: int) -> str:
    try:
        cudart = torch.cuda.cudart()
        return f"{code} ({cudart.cudaGetErrorString(cudart.cudaError(code))})"
    except Exception:  # no CUDA runtime to name it (e.g. the registration itself was replaced in a test)
        return str(code)


def _memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


host_observers: list[Callable[[torch.Tensor], None]] = []
"""Called with every buffer `host_empty` returns (measure.py tells host from device memory by them)."""


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer; page-locked when it is a DMA source or target so copies can be asynchronous. Every
    host buffer the engine owns comes from here.

    Pinned buffers are registered at their exact size (engine/host/pinned.py), not taken from torch's caching
    host allocator, which would round each one up to a power of two."""
    t = pinned_empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype)
    for observe in host_observers:
        observe(t)
    return t
