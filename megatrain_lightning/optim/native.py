"""Native fused CPU AdamW kernel (csrc/adamw.cpp), loaded with ctypes.

One pass over memory per step: reads master, exp_avg, exp_avg_sq (fp32) and the gradient (fp32 or
bf16), writes master, exp_avg, exp_avg_sq and, optionally, the compute-dtype copy of the new master
(fp32 or bf16) that goes to the GPU. torch's fused CPU AdamW needs two extra passes for the same job
(grad bf16 -> fp32 before, master -> bf16 after).

The numerics follow torch's single-tensor AdamW op by op (see csrc/adamw.cpp): results agree with
``torch.optim.AdamW(foreach=False)`` and ``torch.optim.AdamW(fused=True)`` to float rounding, and the
bf16 copy equals ``master.to(torch.bfloat16)`` bit for bit (NaN is written as 0xFFFF, as ATen's
vectorized conversion does).

There is no silent fallback here: when the library cannot be loaded, :func:`available` is False, the
kernels raise ``RuntimeError``, and a warning is issued once; the caller picks the torch path.
Set ``MEGATRAIN_NATIVE_ADAMW=0`` to turn the kernel off on purpose (no warning then).

The calls release the GIL (ctypes), so they can overlap with Python work on other threads.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import warnings

import torch

__all__ = [
    "available",
    "backend",
    "load_error",
    "info",
    "adamw_step_",
    "adamw_peek_",
    "grad_accumulate_",
    "sq_norm",
    "set_num_threads",
    "get_num_threads",
    "set_team_cpus",
    "set_isa",
]

LIBRARY_MODULE = "megatrain_lightning._adamw_native"
DISABLE_ENV = "MEGATRAIN_NATIVE_ADAMW"
_ABI_VERSION = 3  # 3: adamw_peek
_ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
_ISA_LEVELS = {name: level for level, name in _ISA_NAMES.items()}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_REBUILD_HINT = (
    "rebuild it with `pip install -e .` from the repository root (needs a C++17 compiler with OpenMP, "
    "e.g. g++; the build log says why it was skipped)"
)

_lock = threading.Lock()
_tried = False
_lib: ctypes.CDLL | None = None
_error: str | None = None
_path: str | None = None


def _open_library() -> tuple[ctypes.CDLL, str]:
    spec = importlib.util.find_spec(LIBRARY_MODULE)
    if spec is None or not spec.origin:
        raise ImportError(f"{LIBRARY_MODULE} is not built (the optional extension was skipped at install)")
    path = spec.origin
    lib = ctypes.CDLL(path)
    lib.mt_abi_version.restype = ctypes.c_int
    lib.mt_abi_version.argtypes = []
    abi = lib.mt_abi_version()
    if abi != _ABI_VERSION:
        raise ImportError(f"{path} has ABI version {abi}, this native.py expects {_ABI_VERSION} (stale build)")

    p, i, i64, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    for name in ("adamw_step", "adamw_peek"):
        getattr(lib, name).restype = i
        getattr(lib, name).argtypes = [p, p, p, p, i, p, i, i64, d, d, d, d, d, d, d, d, i]
    lib.grad_accumulate.restype = i
    lib.grad_accumulate.argtypes = [p, p, i, i64, i]
    lib.sq_norm.restype = d
    lib.sq_norm.argtypes = [p, i, i64]
    for name in ("mt_isa", "mt_isa_supported", "mt_has_openmp", "mt_get_num_threads"):
        getattr(lib, name).restype = i
        getattr(lib, name).argtypes = []
    lib.mt_set_isa.restype = i
    lib.mt_set_isa.argtypes = [i]
    lib.mt_set_num_threads.restype = None
    lib.mt_set_num_threads.argtypes = [i]
    lib.mt_set_team_cpus.restype = i
    lib.mt_set_team_cpus.argtypes = [ctypes.POINTER(ctypes.c_int), i]
    return lib, path


def _load() -> ctypes.CDLL | None:
    global _tried, _lib, _error, _path
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
            _error = f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        else:
            try:
                _lib, _path = _open_library()
            except Exception as exc:  # ImportError, OSError (missing libgomp, bad ELF), AttributeError
                _error = f"{type(exc).__name__}: {exc}"
                warnings.warn(
                    f"megatrain_lightning: the native CPU AdamW kernel could not be loaded ({_error}); "
                    f"the optimizer falls back to torch ops (extra passes over memory, slower). To get "
                    f"it back, {_REBUILD_HINT}. Set {DISABLE_ENV}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _tried = True
        return _lib


def available() -> bool:
    """True when the native library is loaded and its kernels can be called."""
    return _load() is not None


def load_error() -> str | None:
    """Why the library is not loaded (None when it is)."""
    _load()
    return _error


def backend() -> str:
    """``"native-avx512"``, ``"native-avx2"`` or ``"native-scalar"`` (the code path calls use now), or
    ``"torch (<why the native kernel is not loaded>)"``: test with ``.startswith("native")``."""
    lib = _load()
    if lib is None:
        return f"torch ({_error})"
    return f"native-{_ISA_NAMES.get(lib.mt_isa(), 'unknown')}"


def info() -> dict:
    """What is loaded: path, ISA in use and best supported, OpenMP, thread count (or the error)."""
    lib = _load()
    if lib is None:
        return {"available": False, "error": _error}
    return {
        "available": True,
        "path": _path,
        "isa": _ISA_NAMES.get(lib.mt_isa(), "unknown"),
        "isa_supported": _ISA_NAMES.get(lib.mt_isa_supported(), "unknown"),
        "openmp": bool(lib.mt_has_openmp()),
        "num_threads": lib.mt_get_num_threads(),
    }


def _require() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(
            f"the native CPU AdamW kernel is not available ({_error}); check "
            f"megatrain_lightning.optim.native.available() and use the torch optimizer instead, or "
            f"{_REBUILD_HINT}"
        )
    return lib


def set_num_threads(n: int | None) -> None:
    """Threads every later kernel call may use, whichever Python thread calls, independent of
    ``torch.set_num_threads``. ``None`` or 0 (the initial state): the OpenMP default of the calling
    thread, i.e. ``OMP_NUM_THREADS`` or all CPUs, or what ``torch.set_num_threads`` set in that thread
    (torch and this library share one libgomp when torch is loaded first). Each thread gets at least
    32K elements, so smaller calls use fewer threads (below 64K elements, the calling thread only). Without OpenMP in the build the kernel is single-threaded."""
    lib = _require()
    if n is None:
        n = 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"set_num_threads: n={n!r} must be a non-negative int (or None for the default)")
    lib.mt_set_num_threads(n)


def get_num_threads() -> int:
    """Threads a large kernel call from this thread would use."""
    return _require().mt_get_num_threads()


def set_team_cpus(cpus: list[int] | None) -> bool:
    """Place the threads of the kernel calls made from *this* Python thread: member ``t >= 1`` of a call's
    team (an OpenMP helper thread) moves onto CPU ``cpus[t]`` when the call starts and stays there until
    the list changes; ``cpus[0]`` stands for the calling thread itself, whose affinity is not touched.
    ``None`` or ``[]``: no placement (helpers go back to the CPUs they had, at their next call). Calls
    from other threads are not affected. Results do not depend on placement.

    Returns whether threads can be placed (Linux and an OpenMP build); otherwise this is a no-op.
    :func:`megatrain_lightning.optim.threads.configure_host_threads` computes the list from the NUMA nodes.
    """
    lib = _require()
    cpus = list(cpus or [])
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
        raise ValueError(f"set_team_cpus: cpus={cpus!r} must be non-negative CPU numbers (or None for no placement)")
    array = (ctypes.c_int * len(cpus))(*cpus)
    return bool(lib.mt_set_team_cpus(array, len(cpus)))


def set_isa(isa: str | None) -> str:
    """Cap the instruction set the kernels use: ``"scalar"``, ``"avx2"``, ``"avx512"`` or ``None``
    (the best the CPU supports). For tests and benchmarks; all paths give bitwise identical results.
    Returns the ISA now in use, which is never above what the CPU supports."""
    lib = _require()
    if isa is None:
        level = -1
    elif isa in _ISA_LEVELS:
        level = _ISA_LEVELS[isa]
    else:
        raise ValueError(f"set_isa: isa={isa!r} is not one of {sorted(_ISA_LEVELS)} or None")
    return _ISA_NAMES[lib.mt_set_isa(level)]


# ----------------------------------------------------------------------------------------------------
# Argument checks


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _check(fn: str, name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{fn}: {name} is on device {t.device}, the native kernel works on host memory only; "
            f"pass a CPU tensor (e.g. {name}.cpu()) or use the torch optimizer for device tensors"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{fn}: {name} has layout {t.layout}; pass a dense (strided) tensor")
    if t.dtype not in dtypes:
        raise TypeError(
            f"{fn}: {name} has dtype {str(t.dtype).replace('torch.', '')}, expected {_dtype_names(dtypes)}; "
            f"convert it with {name}.to(torch.{str(dtypes[0]).replace('torch.', '')})"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{fn}: {name} is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}); "
            f"pass {name}.contiguous() or a view of a flat buffer"
        )


def _check_numel(fn: str, ref_name: str, n: int, name: str, t: torch.Tensor) -> None:
    if t.numel() != n:
        raise ValueError(
            f"{fn}: {name} has {t.numel()} elements but {ref_name} has {n}; all buffers of one call must "
            f"cover the same parameters"
        )


def _check_disjoint(fn: str, named: list[tuple[str, torch.Tensor]]) -> None:
    spans = []
    for name, t in named:
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{fn}: {n1} overlaps {n0} in memory; each buffer needs its own storage")


_F32 = (torch.float32,)
_F32_BF16 = (torch.float32, torch.bfloat16)


def _as_float(fn: str, name: str, x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{fn}: {name}={x!r} must be a real number") from None


# ----------------------------------------------------------------------------------------------------
# Kernels


def adamw_step_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out_copy: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
) -> None:
    """One AdamW step in place on ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, contiguous, CPU).

    ``grad`` (fp32 or bf16) is multiplied by ``grad_scale`` first (e.g. ``1/loss_scale`` or a clipping
    coefficient). ``step`` is the 1-based step count after this update (torch's ``state["step"]``),
    used for the bias corrections. ``decoupled=False`` gives Adam with L2 weight decay
    (``torch.optim.Adam``). ``out_copy`` (fp32 or bf16, or None) receives the new master, rounded to
    nearest even for bf16, in the same pass.
    """
    _adam(
        "adamw_step_",
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out_copy,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
        decoupled,
    )


def adamw_peek_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out_copy: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    decoupled: bool = True,
) -> None:
    """Write into ``out_copy`` the new weights :func:`adamw_step_` would write there, bit for bit, leaving
    ``master``, ``exp_avg`` and ``exp_avg_sq`` as they are (read only): a step that may yet be discarded."""
    if out_copy is None:
        raise ValueError("adamw_peek_: out_copy=None; a peek writes its result there alone: pass a tensor")
    _adam(
        "adamw_peek_",
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out_copy,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
        decoupled,
    )


def _adam(
    fn, master, exp_avg, exp_avg_sq, grad, out_copy, lr, beta1, beta2, eps, weight_decay, step, grad_scale, decoupled
) -> None:
    """adamw_step_ (``fn``) or adamw_peek_: the checks, then the library's call of that name."""
    lib = _require()
    _check(fn, "master", master, _F32)
    _check(fn, "exp_avg", exp_avg, _F32)
    _check(fn, "exp_avg_sq", exp_avg_sq, _F32)
    _check(fn, "grad", grad, _F32_BF16)
    n = master.numel()
    named = [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)]
    if out_copy is not None:
        _check(fn, "out_copy", out_copy, _F32_BF16)
        named.append(("out_copy", out_copy))
    for name, t in named[1:]:
        _check_numel(fn, "master", n, name, t)
    _check_disjoint(fn, named)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{fn}: step={step!r} must be an int >= 1 (the step count after this update)")
    lr_f = _as_float(fn, "lr", lr)
    beta1_f = _as_float(fn, "beta1", beta1)
    beta2_f = _as_float(fn, "beta2", beta2)
    eps_f = _as_float(fn, "eps", eps)
    wd_f = _as_float(fn, "weight_decay", weight_decay)
    gs_f = _as_float(fn, "grad_scale", grad_scale)
    if not (0.0 <= beta1_f < 1.0 and 0.0 <= beta2_f < 1.0):
        raise ValueError(f"{fn}: beta1={beta1!r}, beta2={beta2!r} must lie in [0, 1)")
    if n == 0:
        return
    # exactly torch's _single_tensor_adam: bias_correction = 1 - beta**step, sqrt via ** 0.5
    bias_correction1 = 1 - beta1_f**step
    bias_correction2_sqrt = (1 - beta2_f**step) ** 0.5
    rc = getattr(lib, fn.removesuffix("_"))(
        master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        grad.data_ptr(),
        _DTYPE_CODES[grad.dtype],
        None if out_copy is None else out_copy.data_ptr(),
        0 if out_copy is None else _DTYPE_CODES[out_copy.dtype],
        n,
        lr_f,
        beta1_f,
        beta2_f,
        eps_f,
        wd_f,
        bias_correction1,
        bias_correction2_sqrt,
        gs_f,
        1 if decoupled else 0,
    )
    if rc != 0:
        raise RuntimeError(f"{fn}: native {fn.removesuffix('_')} returned {rc}")


def grad_accumulate_(acc: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """``acc = grad`` (``first=True``) or ``acc += grad``, in fp32; ``grad`` fp32 or bf16."""
    fn = "grad_accumulate_"
    lib = _require()
    _check(fn, "acc", acc, _F32)
    _check(fn, "grad", grad, _F32_BF16)
    _check_numel(fn, "acc", acc.numel(), "grad", grad)
    _check_disjoint(fn, [("acc", acc), ("grad", grad)])
    if acc.numel() == 0:
        return
    rc = lib.grad_accumulate(acc.data_ptr(), grad.data_ptr(), _DTYPE_CODES[grad.dtype], acc.numel(), 1 if first else 0)
    if rc != 0:
        raise RuntimeError(f"{fn}: native grad_accumulate returned {rc}")


def sq_norm(x: torch.Tensor) -> float:
    """Sum of squares of ``x`` (fp32 or bf16), accumulated in double: ``sqrt`` of it is the L2 norm
    (for gradient clipping; sum it over buffers first). NaN/inf in ``x`` give a NaN/inf result."""
    fn = "sq_norm"
    lib = _require()
    _check(fn, "x", x, _F32_BF16)
    if x.numel() == 0:
        return 0.0
    return float(lib.sq_norm(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel()))
