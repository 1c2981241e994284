"""The ``megatrain`` command (``python -m megatrain_lightning`` is the same).

- ``main.py``: the entry point, which imports Lightning only for the subcommands that train; ``fit.py``: ``fit``
  and Lightning's other subcommands as a ``LightningCLI`` over the project's module and data module; ``checks.py``: the input checks that turn a mistake into one line;
  ``console.py``: the progress bar and loggers a run shows whatever is installed.
- ``commands.py``: ``plan``, ``schedule`` and ``convert``, which size, predict and convert without training;
  ``env.py``: ``megatrain env``.

Nothing below the command line imports this package. Nothing is imported here.
"""
