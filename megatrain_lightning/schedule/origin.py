"""Whose work a recorded GPU kernel is: the model's, or the engine's own (and which engine function's).

The recorder (record.py) asks at each op it logs. The answer is read off the Python stack: the nearest caller
that is not torch, the standard library, the recorder itself or measure.py's device-bytes mode (stacked under
the recorder), and not a mode's ``__torch_function__`` passing its caller's op on. A function of the engine
(engine/, optim/) there makes the op the engine's, named by that function (packing gradients, fingerprints,
casts, norms, device sums), except the functions through which the model's own code runs (autograd
differentiating a block's ops, the calls that run a block). Anything else (the model's forward, its autograd
backward started by the loop's ``loss.backward()``, the loss) is the model's.
"""

from __future__ import annotations

import os
import sys

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENGINE = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("engine", "optim"))
# The recorder, torch and planning/measure.py's device-bytes mode (stacked under the recorder) only pass an op on;
# the recorded training loop (schedule/steps.py) is the user's code, its ops the model's.
_PASSING = (
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "record.py"),
    os.path.dirname(torch.__file__) + os.sep,
    os.path.join(_PACKAGE, "planning", "measure.py"),
)
_STDLIB = os.path.dirname(os.__file__) + os.sep
_MODES = {"__torch_function__", "__torch_dispatch__"}
# Engine functions through which the model's own work runs: autograd differentiating a block's ops, and
# the calls that run a block, so an op issued under them (and under no nearer engine function) is the model's.
_RUNS_THE_MODEL = {"differentiate", "recompute", "forward", "backward", "__call__", "call"}


def origin() -> str:
    """Whose work the op being issued is: ``"engine:<function>"`` when the nearest caller outside torch, the
    standard library and this recorder is a function of the engine (engine/, optim/) other than those that
    run the model's code, else ``"model"`` (the model's forward, its autograd backward, the loss)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        passing = path.startswith(_PASSING) or frame.f_code.co_name in _MODES  # (a mode passes the caller's op on)
        if passing or (path.startswith(_STDLIB) and "site-packages" not in path):
            frame = frame.f_back
            continue
        if path.startswith(_ENGINE) and frame.f_code.co_name not in _RUNS_THE_MODEL:
            return f"engine:{frame.f_code.co_name}"
        return "model"
    return "model"
