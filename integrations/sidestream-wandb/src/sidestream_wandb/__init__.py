"""Weights & Biases integration for sidestream."""

from importlib.metadata import version

from sidestream_wandb.sink import WandbSink

__all__ = ["WandbSink", "__version__"]

__version__ = version("sidestream-wandb")
