"""torchmetrics metrics as sidestream metrics."""

from sidestream._version import distribution_version

try:
    from sidestream_torchmetrics.collection import TorchmetricsCollection
    from sidestream_torchmetrics.metric import TorchmetricsMetric, UnsupportedStateError
    from sidestream_torchmetrics.wrap import wrap
except ModuleNotFoundError as error:
    if error.name != "torchmetrics":
        raise  # torchmetrics is there, not one of its own dependencies: its message says which
    # Not a bare "No module named 'torchmetrics'": name the extra that installs it, as the
    # tracker sinks do.
    raise ModuleNotFoundError(
        f"sidestream_torchmetrics needs torchmetrics ({error}): pip install "
        '"sidestream[torchmetrics]" (from a checkout of the repository: pip install '
        "./packages/sidestream ./integrations/sidestream-torchmetrics)",
        name="torchmetrics",
    ) from None

__all__ = [
    "TorchmetricsCollection",
    "TorchmetricsMetric",
    "UnsupportedStateError",
    "__version__",
    "wrap",
]

__version__ = distribution_version("sidestream-torchmetrics", __file__)
