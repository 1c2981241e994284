"""``python -m megatrain_lightning ...`` is the ``megatrain`` command (see megatrain_lightning.cli.main)."""

from megatrain_lightning.cli.main import main

main()
