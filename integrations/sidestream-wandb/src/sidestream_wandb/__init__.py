"""Weights & Biases integration for sidestream."""

from importlib.metadata import version

__all__ = ["__version__"]

__version__ = version("sidestream-wandb")
