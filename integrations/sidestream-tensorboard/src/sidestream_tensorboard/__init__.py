"""TensorBoard integration for sidestream."""

from importlib.metadata import version

from sidestream_tensorboard.sink import TensorBoardSink

__all__ = ["TensorBoardSink", "__version__"]

__version__ = version("sidestream-tensorboard")
