"""What the ``megatrain`` command checks of a run's input before anything is built: the Trainer, strategy and
data options, the URLs it writes to, the checkpoint it resumes from, and the config files as written. Each
mistake becomes one ValueError (or ``user_error``) naming the option, the value and the fix; megatrain_lightning/
main.py turns them into ``megatrain: error: ...``."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import fsspec

from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.checkpoint import trust
from megatrain_lightning.checkpoint.options import check_storage_options
from megatrain_lightning.cli.commands import read_config, user_error
from megatrain_lightning.engine import check_keep_attention, check_offload_inputs_dtype, check_options, check_precision
from megatrain_lightning.lightning.strategy import OWN_CHECKS, check_trainer_args

SUBCOMMANDS = ("fit", "validate", "test", "predict")

OPTION_HINTS = {
    "trainer.precision": "use 32-true, bf16-mixed or bf16-true, or null for the default (bf16-mixed on a GPU, "
    "32-true on the CPU); strategy='megatrain' refuses fp16",
}


def check_urls(trainer: Any) -> None:
    """Where the run writes (the root directory, a callback's dirpath): a URL's scheme must be one fsspec has."""
    check_url("--trainer.default_root_dir", trainer.default_root_dir)
    callbacks = trainer.callbacks if isinstance(trainer.callbacks, list) else [trainer.callbacks]
    for callback in callbacks:
        init_args = getattr(callback, "init_args", None) or {}
        if "dirpath" in init_args:
            check_url(f"{callback.class_path.rsplit('.', 1)[-1]} dirpath", init_args["dirpath"])


def check_url(option: str, value: Any) -> None:
    """A ValueError naming `value` when its URL scheme is one fsspec does not know or cannot load (fsspec's
    own errors come up as tracebacks from deep inside Lightning); a local path passes."""
    if not isinstance(value, (str, os.PathLike)):
        return
    protocol = fsspec.core.split_protocol(os.fspath(value))[0]
    if protocol is None:
        return
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"{option}={os.fspath(value)!r}: {protocol}:// is not a scheme fsspec knows; give a local path or a "
            "URL such as s3://bucket/run, gs://..., az://..., hdfs://..., memory://... "
            "(python -c 'import fsspec; print(fsspec.available_protocols())' lists them all)"
        ) from None
    except ImportError as err:
        raise ValueError(f"{option}={os.fspath(value)!r}: {trust.first_line(err)}, or give a local path") from None


def check_trainer(trainer: Any) -> None:
    """The Trainer options Lightning would accept and then fail on or misread (strategy.py), and the precision."""
    check_trainer_args(
        trainer.accumulate_grad_batches,
        trainer.gradient_clip_val,
        trainer.gradient_clip_algorithm,
        trainer.val_check_interval,
    )
    precision = _precision_name(trainer.precision)
    try:
        check_precision(precision)
    except ValueError:
        raise ValueError(f"--trainer.precision={trainer.precision}: {OPTION_HINTS['trainer.precision']}") from None


def _precision_name(value: Any) -> str:
    """Lightning's short precision names in full ("32" is "32-true")."""
    return {"32": "32-true", "bf16": "bf16-mixed"}.get(str(value), str(value))


def check_strategy(strategy: Any, precision: Any) -> None:
    """MegatrainStrategy options given as ``--trainer.strategy.init_args.*``: the strategy's own checks, here
    (jsonargparse would print every type it tried), the options that depend on the (checked) precision, and
    the NVMe directory, before the model is built."""
    if not str(getattr(strategy, "class_path", "")).endswith("MegatrainStrategy"):
        return
    args = vars(strategy.get("init_args") or {})
    check_options(args, OWN_CHECKS)
    check_storage_options(args.get("storage_options"))  # e.g. a saved config's placeholders
    check_offload_inputs_dtype(args.get("offload_inputs_dtype"), _precision_name(precision))
    check_keep_attention(bool(args.get("keep_attention")), args.get("offload_inputs_dtype"))
    nvme_dir = args.get("nvme_dir")
    if nvme_dir is not None and not Path(nvme_dir).is_dir():
        what = "is not a directory" if Path(nvme_dir).exists() else "does not exist"
        raise ValueError(
            f"nvme_dir={nvme_dir!r} {what}; create it on a local drive (mkdir -p {nvme_dir}), or leave nvme_dir "
            "unset to keep the Adam moments in host memory"
        )


def check_seq_len(seq_len: int, max_positions: int) -> None:
    if seq_len > max_positions:
        raise ValueError(
            f"--data.seq_len={seq_len} is above the model's max_position_embeddings={max_positions}: give a "
            f"seq_len from 1 to {max_positions}, or raise --model.overrides.max_position_embeddings"
        )


_CKPT_KEYWORDS = ("last", "best", "hpc")


def check_ckpt_path(path: str) -> None:
    """A local --ckpt_path must name an existing checkpoint file (Lightning's keywords pass through)."""
    if path in _CKPT_KEYWORDS or path.startswith("registry"):
        return
    if "://" in path and not path.startswith("file://"):
        try:
            check_url("ckpt_path", path)
        except ValueError as err:
            user_error(str(err))
        return
    local = Path(path.removeprefix("file://")).expanduser()
    if local.is_dir():
        user_error(
            f"ckpt_path={path!r} is a directory; give the checkpoint file in it, e.g. {path.rstrip('/')}/last.ckpt"
        )
    if not local.is_file() and mt_checkpoint.is_checkpoint(str(local)):  # its data, without a marker
        try:
            mt_checkpoint.store.read_index(str(local))
        except mt_checkpoint.CheckpointError as err:
            user_error(f"ckpt_path={path!r}: {err}")
    if not local.is_file():
        user_error(
            f"ckpt_path={path!r} does not exist; give a checkpoint file, e.g. "
            "lightning_logs/version_0/checkpoints/last.ckpt, or 'last'"
        )


_FULL = (errno.ENOSPC, errno.EDQUOT)


def no_space(err: BaseException) -> OSError | None:
    """The OSError of a full drive or an exhausted quota behind `err` (it, or what it was raised from)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno in _FULL:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def load_error(err: BaseException) -> str:
    """The telling part of a torch.load failure (its weights-only refusal opens with a paragraph of advice)."""
    return f"{type(err).__name__}: {trust.first_line(err)}"


_OPTIMIZER_FIX = (
    "set --model.lr, --model.weight_decay, --model.betas, --model.warmup_steps and --model.max_steps instead"
)


def refuse_optimizer_options(config: Any) -> None:
    """LightningCLI's --optimizer/--lr_scheduler replace the module's configure_optimizers outright."""
    for key in ("optimizer", "lr_scheduler"):
        value = config.get(key)
        if value is None:
            continue
        name = getattr(value, "class_path", value)
        user_error(
            f"--{key}={name} would replace CausalLMModule.configure_optimizers, which sets up AdamW with param groups "
            "(no weight decay on norms and biases) and the warm-up + cosine learning-rate schedule; " + _OPTIMIZER_FIX
        )


def check_config_files(args: list[str]) -> None:
    """A --config file that is missing or unreadable gets one line naming it (and the ready configs), not
    the full usage or jsonargparse's traceback."""
    for path in _config_args(args):
        try:
            _check_strategy_as_written(path, read_config(path))
        except FileNotFoundError as err:
            ready = sorted(str(p) for p in Path("configs").glob("*.yaml"))
            hint = "the ready configs are in the repository's configs/"
            if ready:
                hint = f"ready configs here: {', '.join(ready)}"
            user_error(f"{err}; {hint}")
        except ValueError as err:
            user_error(str(err))


def _check_strategy_as_written(path: str, config: dict[str, Any]) -> None:
    """The strategy's options in a config file, checked as YAML loaded them: jsonargparse reads a quoted
    ``'yes'``, ``'on'`` or ``'false'`` given for a boolean as the boolean, so a string would be taken for a
    yes/no it only looks like. (On the command line every value is text, read as YAML: true/false there.)"""
    nested = [config[sub] for sub in SUBCOMMANDS if isinstance(config.get(sub), dict)]  # megatrain --config
    for trainer in [config.get("trainer"), *(sub.get("trainer") for sub in nested)]:
        strategy = trainer.get("strategy") if isinstance(trainer, dict) else None
        init_args = strategy.get("init_args") if isinstance(strategy, dict) else None
        if not isinstance(init_args, dict):
            continue
        try:
            check_options(init_args, OWN_CHECKS)
        except ValueError as err:
            key = str(err).split("=", 1)[0]  # the checks' messages open with the option: key=value
            value = init_args.get(key)
            quoted = isinstance(value, str) and value.lower() in _WORDS_FOR_BOOLEANS
            hint = f"; write {key}: true or false, unquoted (a quoted word is a string)" if quoted else ""
            raise ValueError(f"config file {path!r}: trainer.strategy.init_args.{err}{hint}") from None


_WORDS_FOR_BOOLEANS = ("true", "false", "yes", "no", "on", "off", "y", "n")


def _config_args(args: list[str]) -> list[str]:
    paths = [a.split("=", 1)[1] for a in args if a.startswith(("--config=", "-c="))]
    return paths + [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-c", "--config")]
