"""The asynchronous collector: windows reduced, computed and logged off the training thread."""

from sidestream.collector._tree import FlatTree, flatten_tree
from sidestream.collector.collector import AsyncMetricCollector

__all__ = ["AsyncMetricCollector", "FlatTree", "flatten_tree"]
