"""Weights & Biases integration for sidestream."""

from sidestream._version import distribution_version
from sidestream_wandb.sink import FLUSH_INTERVAL_S, MIN_WANDB_VERSION, WandbSink

__all__ = ["FLUSH_INTERVAL_S", "MIN_WANDB_VERSION", "WandbSink", "__version__"]

__version__ = distribution_version("sidestream-wandb", __file__)
