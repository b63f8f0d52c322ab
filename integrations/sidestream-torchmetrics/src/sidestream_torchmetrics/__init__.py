"""torchmetrics metrics as sidestream metrics."""

from sidestream._version import distribution_version
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

__version__ = distribution_version("sidestream-torchmetrics", __file__)
