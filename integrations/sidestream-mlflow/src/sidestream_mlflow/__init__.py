"""MLflow integration for sidestream."""

from sidestream._version import distribution_version
from sidestream_mlflow.sink import MlflowSink

__all__ = ["MlflowSink", "__version__"]

__version__ = distribution_version("sidestream-mlflow", __file__)
