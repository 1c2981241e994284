"""megatrain_lightning: train models larger than GPU memory on one GPU with host-resident state."""

__version__ = "0.1.0"
