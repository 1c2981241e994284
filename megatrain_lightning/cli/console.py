"""What a ``megatrain`` run shows and logs, the same whatever else happens to be installed.

Lightning picks its defaults by what it finds: the rich progress bar when ``rich`` is importable (it draws
nothing into a redirected log), and the TensorBoard logger when ``tensorboard`` or ``tensorboardX`` is (whose
events file needs ``tensorboard`` to read); the test and Ray extras bring both. A run of the ``megatrain``
command instead always gets Lightning's tqdm bar, its plain-text model summary and a ``metrics.csv``
(``CSVLogger``); loggers the config names (TensorBoard, W&B, ...) log beside it, and
``--trainer.logger=false`` turns logging off.

Two notices that are nobody's to act on are kept off the console: Lightning's "Tip" advertising a hosted
logger, and torch's deprecation warning for Lightning's own use of ``LeafSpec`` (torch >= 2.13).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from typing import Any

from lightning.pytorch.callbacks import ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger


def loggers(logger: Any, root_dir: str | None) -> Any:
    """The Trainer's ``logger`` argument: a ``CSVLogger`` under ``root_dir`` first (it names the run's
    ``lightning_logs/version_N`` directory, where the checkpoints go too), then the loggers the config names.
    ``False`` stays off; a config that names a ``CSVLogger`` itself keeps its own."""
    if logger is False:
        return False
    given = [] if logger in (None, True) else list(logger) if isinstance(logger, Iterable) else [logger]
    if any(isinstance(one, CSVLogger) for one in given):
        return given
    return [CSVLogger(save_dir=root_dir or os.getcwd()), *given]


def plain_callbacks(config: dict[str, Any], given: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """Lightning's tqdm bar and plain-text model summary, each unless turned off or named among the ``given``
    callbacks (e.g. ``RichProgressBar``). Lightning would add the rich ones when ``rich`` is installed; the
    summary is added here with ``enable_model_summary=False`` so that Lightning neither adds its own nor says
    that it skipped it."""
    extra: list[Any] = []
    if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
        extra.append(TQDMProgressBar())
    if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in given):
        config, extra = {**config, "enable_model_summary": False}, [*extra, ModelSummary()]
    return config, extra


def trainer_defaults(config: dict[str, Any], callbacks: list[Any]) -> tuple[dict[str, Any], list[Any]]:
    """The instantiated Trainer arguments and the extra callbacks, with the logger, bar and summary above
    (``barebones`` runs have none of them, as Lightning wants)."""
    if config.get("barebones"):
        return config, callbacks
    given = config.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    config, extra = plain_callbacks(config, [*given, *callbacks])
    return {**config, "logger": loggers(config.get("logger"), config.get("default_root_dir"))}, [*callbacks, *extra]


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_known_notices() -> None:
    """Keep the two notices above off the console (idempotent: filters are added once)."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTip) for f in log.filters):
        log.addFilter(_DropTip())
