"""torchmetrics metrics as sidestream metrics."""

from importlib.metadata import version

from sidestream_torchmetrics.collection import TorchmetricsCollection
from sidestream_torchmetrics.metric import TorchmetricsMetric, UnsupportedStateError
from sidestream_torchmetrics.wrap import wrap

__all__ = [
    "TorchmetricsCollection",
    "TorchmetricsMetric",
    "UnsupportedStateError",
    "__version__",
    "wrap",
]

__version__ = version("sidestream-torchmetrics")
