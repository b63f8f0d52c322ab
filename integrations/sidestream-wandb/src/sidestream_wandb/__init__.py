"""Weights & Biases integration for sidestream."""

from importlib.metadata import version

from sidestream_wandb.sink import FLUSH_INTERVAL_S, WandbSink

__all__ = ["FLUSH_INTERVAL_S", "WandbSink", "__version__"]

__version__ = version("sidestream-wandb")
