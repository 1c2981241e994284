"""Build hook for the optional native CPU optimizer (csrc/).

The extension is marked optional: when the system compiler or OpenMP is missing, the package still
installs and the optimizer runs on torch ops instead (megatrain_lightning.optim says so once).
"""

from setuptools import setup

setup()
