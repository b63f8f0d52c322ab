"""MLflow integration for sidestream."""

from importlib.metadata import version

from sidestream_mlflow.sink import MlflowSink

__all__ = ["MlflowSink", "__version__"]

__version__ = version("sidestream-mlflow")
