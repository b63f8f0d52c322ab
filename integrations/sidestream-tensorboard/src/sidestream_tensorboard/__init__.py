"""TensorBoard integration for sidestream."""

from sidestream._version import distribution_version
from sidestream_tensorboard.sink import TensorBoardSink

__all__ = ["TensorBoardSink", "__version__"]

__version__ = distribution_version("sidestream-tensorboard", __file__)
