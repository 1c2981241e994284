"""Lightning around the engine: what a ``Trainer`` or ``Fabric`` run uses.

- ``strategy.py``: ``Trainer(strategy="megatrain")``; ``fabric.py``: ``Fabric(strategy="megatrain")``; both drive
  one ``Engine`` through its public calls, with the precision plugins of ``precision.py``.
- ``averaging.py``: Lightning's EMA / SWA callbacks on the engine's fp32 masters; ``peers.py``: the one line a
  data-parallel run ends with when a rank exits.
- ``module.py``, ``data.py``: the LightningModule and the data module the shipped configs name (``demo.py``:
  the built-in corpus the demo's data module reads); ``callbacks.py``: live figures and the demo's export;
  ``plots.py``: the loss curve the demo draws and the plan figure ``megatrain plan --png`` draws.
- ``convert.py``: a sharded checkpoint loaded for inference or written as Lightning's or Hugging Face's files.

Nothing is imported here; the package top imports the strategies and registers them with Lightning.
"""
