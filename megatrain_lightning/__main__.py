"""``python -m megatrain_lightning ...`` is the ``megatrain`` command (see megatrain_lightning.cli)."""

from megatrain_lightning.cli import main

main()
