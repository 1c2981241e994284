"""``megatrain fit`` and Lightning's other subcommands: a ``LightningCLI`` over :class:`CausalLMModule` and
:class:`TextDataModule`, its errors in one line (megatrain_lightning.cli.main dispatches here; the command's
other subcommands never import Lightning)."""

from __future__ import annotations

import os
import pickle
import re
import sys
import warnings
from typing import Any, NoReturn

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.checkpoint.options import REDACTED, SECRET_KEYS, redact_secrets
from megatrain_lightning.cli import console
from megatrain_lightning.cli.checks import (
    OPTION_HINTS,
    SUBCOMMANDS,
    check_ckpt_path,
    check_config_files,
    check_seq_len,
    check_strategy,
    check_trainer,
    check_urls,
    load_error,
    no_space,
    refuse_optimizer_options,
)
from megatrain_lightning.cli.commands import default_precision, user_error
from megatrain_lightning.engine import HostMemoryError, NvmeTierError
from megatrain_lightning.lightning.callbacks import MegatrainMonitor
from megatrain_lightning.lightning.data import TextDataModule
from megatrain_lightning.lightning.module import CausalLMModule, check_init_from, check_optimizer_args, resolve_config
from megatrain_lightning.lightning.peers import RankExitedError


def one_line(message: str, prog: str = "megatrain fit") -> str:
    """A jsonargparse error (often many lines: every type tried) as one line naming the option and value."""
    found = re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.S)
    if not found:
        return f"{' '.join(message.split())} (`{prog} --help` lists the options)"
    key, detail = found.groups()
    nested = re.findall(r'Parser key "([^"]+)":\s*(.*?)\s*(?:Got|Given) value:\s*(.+)', detail, re.S)
    if nested:  # a class's own argument (e.g. --trainer.strategy.init_args.host_layout): name it, not the union
        inner, why, value = nested[-1]
        types = re.search(r"Subtypes: ([^\n]*)", why)
        why = why.strip().splitlines()[0].strip().rstrip(".") + (f" {types.group(1)}" if types else "")
        value = value.splitlines()[0].strip()
        if inner.rsplit(".", 1)[-1] in SECRET_KEYS:  # what was typed there may be a credential
            value, why = REDACTED, 'give a mapping of fsspec options such as {"profile": "name"}, or null'
        return f"--{key}.init_args.{inner}={value}: {why}"
    given = re.search(r"(?:Given|Got) value:\s*(.+)", detail)
    value = f"={given.group(1).strip()}" if given else ""
    if key.rsplit(".", 1)[-1] in SECRET_KEYS:  # what was typed there may be a credential
        value = f"={REDACTED}" if given else ""
    hint = OPTION_HINTS.get(key.split(".", 1)[1] if key.split(".", 1)[0] in SUBCOMMANDS else key)
    if hint is None:
        first = detail.strip().splitlines()[0] if detail.strip() else "invalid value"
        hint = re.sub(r"\.?\s*(Got|Given) value:.*", "", first).strip().rstrip(".")
        hint += f" (`{prog} --help` lists the options)"
    return f"--{key}{value}: {hint}"


class MegatrainArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line (the option, the value and the fix), no usage dump."""

    help_prog = "megatrain fit"  # the command whose --help the error points at (set by MegatrainCLI)
    # Set on the parsers MegatrainCLI builds, whose dump is written out; jsonargparse also builds parsers of
    # this class for a class's init_args and dumps them to re-read the values, which must stay whole.
    writes_config = False

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)  # jsonargparse is trying alternatives, or debugging: it raises
        user_error(one_line(message, self.help_prog))

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        """The config as text, ``storage_options`` values redacted: what the saved ``config.yaml`` and
        ``--print_config`` hold (checkpoint/options.py)."""
        return super().dump(redact_secrets(cfg) if self.writes_config else cfg, *args, **kwargs)

    def save(self, cfg: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        """Saved as one file, every value through :meth:`dump` (several files would copy the config files a
        run was given as they were, credentials included)."""
        kwargs["multifile"] = False
        super().save(cfg, path, *args, **kwargs)


class MegatrainProgressBar(RichProgressBar):
    """Lightning's rich progress bar, reading ``Epoch 3`` where Lightning's reads ``Epoch 3/-2``: training
    bounded by ``max_steps`` alone has ``max_epochs=-1`` (no epoch limit), which the bar prints minus one.
    For a run that names it (``--trainer.callbacks+=megatrain_lightning.cli.main.MegatrainProgressBar``); the
    default is Lightning's tqdm bar, which writes its progress into a redirected log too."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


class MegatrainCLI(LightningCLI):
    """LightningCLI with the megatrain defaults and checks of the user's model and data choices."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        given = sys.argv[1:] if args is None else args
        self._help_prog = f"megatrain {next((a for a in given if a in SUBCOMMANDS), 'fit')}"
        self._subcommand = given[0] if given and given[0] in SUBCOMMANDS else None
        super().__init__(
            CausalLMModule,
            TextDataModule,
            trainer_defaults={"strategy": "megatrain"},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "megatrain"},
            parser_class=MegatrainArgumentParser,
            args=args,
            **kwargs,
        )

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        """Only the subcommand asked for, when the arguments open with one: each subcommand's parser takes a
        few hundred milliseconds to build, and a run needs one (`megatrain fit --help` lists fit's options)."""
        every = LightningCLI.subcommands()
        return {self._subcommand: every[self._subcommand]} if self._subcommand in every else every

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Every parser (the main one and each subcommand's) refuses abbreviated options: argparse would take
        a typo such as ``--trainer.max_step=50`` as the one option it prefixes (``max_steps``), silently."""
        parser = super().init_parser(allow_abbrev=False, **kwargs)
        parser.help_prog = self._help_prog
        parser.writes_config = True
        return parser

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(MegatrainMonitor, "monitor")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Without LightningCLI's warning about arguments given both ways (``run(argv)`` from a script with
        arguments of its own): it would print every argument, credentials in storage_options included."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """With --ckpt_path, LightningCLI takes the model's hyper-parameters from the checkpoint by
        ``torch.load``-ing it; a megatrain (sharded) checkpoint is a commit marker keeping them in its
        trainer state instead, so read them from there. A path that is not there, or not a checkpoint,
        is the user's input: one line, before anything is built."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if path is None:
            return super()._parse_ckpt_path()
        check_ckpt_path(str(path))
        if not mt_checkpoint.is_checkpoint(str(path)):
            try:
                return super()._parse_ckpt_path()
            except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as err:
                user_error(
                    f"ckpt_path={path!r}: torch.load cannot read it ({load_error(err)}); give a checkpoint "
                    "written by Lightning or megatrain"
                )
        try:
            hparams = mt_checkpoint.load_trainer_state(str(path)).get("hyper_parameters", {})
        except mt_checkpoint.CheckpointError as err:
            user_error(str(err))
        hparams.pop("_instantiator", None)
        if hparams:
            self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)

    def _set_seed(self) -> None:
        """Seeded after the checks of before_instantiate_classes (seeding logs a line: bad input gets one)."""

    def before_instantiate_classes(self) -> None:
        """Fill in the precision default and check model and data names before anything heavy is built."""
        self._check_options()
        super()._set_seed()

    def _check_options(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        refuse_optimizer_options(config)
        if config.trainer.precision is None:
            config.trainer.precision = default_precision()
        name = config.model.model or config.model.init_from
        try:
            check_urls(config.trainer)
            check_trainer(config.trainer)
            check_strategy(config.trainer.strategy, config.trainer.precision)
            hp = config.model
            check_optimizer_args(hp.lr, hp.weight_decay, hp.betas, hp.warmup_steps, hp.max_steps)
            if isinstance(name, str):  # a full LlamaConfig mapping is checked by LlamaConfig itself
                model = resolve_config(name, config.model.overrides)
                if config.model.init_from is not None:
                    check_init_from(model, config.model.init_from)
                check_seq_len(config.data.seq_len, model.max_position_embeddings)
            TextDataModule(**vars(config.data))  # checks paths and formats; reads no data yet
        except (ValueError, FileNotFoundError, ImportError) as err:  # the user's input: report, don't trace
            user_error(str(err))

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Read the data before the Trainer is built (an empty or unreadable file, or fewer windows than a
        batch, is the user's input: one line; setup keeps what it read, so the Trainer's call reads nothing)."""
        if isinstance(self.datamodule, TextDataModule):
            try:
                self.datamodule.setup(self.subcommand)
            except (ValueError, OSError) as err:
                user_error(" ".join(str(err).split()))
        return super().instantiate_trainer(**kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        """The engine's refusals of the host memory and the NVMe directory, which come before it allocates,
        are the user's to fix: one line too; so is a full drive (or quota) under a save, and a data-parallel run
        ended by the exit of another rank."""
        try:
            super()._run_subcommand(subcommand)
        except (HostMemoryError, NvmeTierError) as err:
            user_error(" ".join(str(err).split()))
        except RankExitedError as err:  # another rank died: not the user's input (status 1), one line all the same
            print(f"megatrain: error: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        except Exception as err:
            full = no_space(err)
            if full is None:
                raise
            user_error(
                f"no space left writing {full.filename or 'a file'!r} ({full.strerror or full}): free space there "
                "or write elsewhere (--trainer.default_root_dir, a checkpoint callback's dirpath); a checkpoint "
                "whose save failed leaves the one committed before it as it was"
            )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        """The tqdm bar and CSV metrics whatever else is installed (console.py), unless the config says otherwise."""
        config, callbacks = console.trainer_defaults(config, callbacks)
        try:
            return super()._instantiate_trainer(config, callbacks)
        except MisconfigurationException as err:  # Lightning's own checks of the Trainer's arguments
            user_error(f"{' '.join(str(err).split())} (`{self._help_prog} --help` lists the options)")

    def before_fit(self) -> None:
        vocab = self.datamodule.vocab_size
        if vocab is not None and vocab > self.model.config.vocab_size:
            user_error(
                f"the data's tokenizer has {vocab} token ids but the model's vocab_size is "
                f"{self.model.config.vocab_size}; use the model's own tokenizer or set --model.overrides.vocab_size"
            )
        self._check_data()

    def _check_data(self) -> None:
        """The data's token ids (read by instantiate_trainer) against the model's vocabulary: one line."""
        try:
            self.datamodule.check_model(self.model.config.vocab_size, self.model.config.max_position_embeddings)
        except ValueError as err:
            user_error(str(err))

    before_validate = _check_data


def fit(argv: list[str] | None) -> Any:
    """Lightning's subcommands (fit, validate, test, predict) with the arguments `argv` (None: sys.argv)."""
    check_config_files(sys.argv[1:] if argv is None else argv)
    console.quiet_known_notices()
    try:
        return MegatrainCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except mt_checkpoint.CheckpointError as err:  # a damaged or foreign --ckpt_path, found while restoring
        user_error(str(err))
