"""Whose work a recorded GPU kernel is: the model's, or the engine's own (and which engine function's).

The recorder (record.py) asks at each op it logs. The answer is read off the Python stack: the nearest caller
that is not torch, the standard library, the recorder itself or measure.py's device-bytes mode (stacked under
the recorder), and not a mode's ``__torch_function__`` passing its caller's op on. A function of the engine
(engine/, optim/) there makes the op the engine's, named by that function (packing gradients, fingerprints,
casts, norms, device sums, the row chunks' gradient sums), except where it is one of the functions through which
the model's own code runs (autograd differentiating a block's ops, the calls that run a block) and autograd is
running one of the model's nodes meanwhile. Anything else (the model's forward, its autograd backward started by
the loop's ``loss.backward()``, the loss) is the model's.
"""

from __future__ import annotations

import os
import sys

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENGINE = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("engine", "optim"))
# This module, the recorder, torch, planning/measure.py's device-bytes mode (stacked under the recorder) and the
# engine's kept attention (which runs the model's attention call in its place) only pass an op on; the recorded
# training loop (schedule/steps.py) is the user's code, its ops the model's.
_PASSING = (
    os.path.abspath(__file__),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "record.py"),
    os.path.dirname(torch.__file__) + os.sep,
    os.path.join(_PACKAGE, "planning", "measure.py"),
    os.path.join(_PACKAGE, "engine", "device", "kept_attention.py"),  # (runs the model's attention call for it)
)
_STDLIB = os.path.dirname(os.__file__) + os.sep
_MODES = {"__torch_function__", "__torch_dispatch__"}
# Engine functions through which the model's own work runs: autograd differentiating a block's ops, and the
# calls that run a block, so an op autograd issues for one of the model's nodes under them is the model's.
_ENGINE_MODULE = __package__.rsplit(".", 1)[0] + ".engine"  # megatrain_lightning.engine
_RUNS_THE_MODEL = {"differentiate", "recompute", "forward", "backward", "__call__", "call"}


def origin() -> str:
    """Whose work the op being issued is: ``"engine:<function>"`` when the nearest caller outside torch, the
    standard library and this recorder is a function of the engine (engine/, optim/), unless that function runs
    the model's code and autograd is running a node of the model's for it; else ``"model"`` (the model's forward,
    its autograd backward, the loss)."""
    code = _nearest_caller()
    if code is not None and code.co_filename.startswith(_ENGINE):
        if code.co_name not in _RUNS_THE_MODEL or not _in_model_node():
            return f"engine:{code.co_name}"
    return "model"


def compiled_graph(whose: str) -> str | None:
    """Which graph of a block compiled by ``compile_blocks=True`` an op issued during a block call belongs to, given
    its :func:`origin` `whose`: ``"backward"`` while autograd runs a node of the model's (the block's own),
    ``"forward"`` when the model's own code issues it (the forward, and its recompute in backward); None for the
    engine's own work between the block's ops (rows.py summing its chunks' gradients), which no compiled graph
    holds."""
    if whose != "model":
        return None
    return "backward" if _in_model_node() else "forward"


def _in_model_node() -> bool:
    """Whether autograd is running a node of the model's now: one of no autograd function of the engine's."""
    node = torch._C._current_autograd_node()
    forward_cls = getattr(node, "_forward_cls", None)
    return node is not None and not getattr(forward_cls, "__module__", "").startswith(_ENGINE_MODULE)


def _nearest_caller():
    """The code of the nearest caller of the op being issued that does not only pass it on (torch, the standard
    library, the recorder, a mode's ``__torch_function__``); None if there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        passing = path.startswith(_PASSING) or frame.f_code.co_name in _MODES  # (a mode passes the caller's op on)
        if passing or (path.startswith(_STDLIB) and "site-packages" not in path):
            frame = frame.f_back
            continue
        return frame.f_code
    return None
