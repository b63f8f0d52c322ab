"""Helpers to test code on several local processes joined by a gloo process group."""

from sidestream.testing._pool import DistributedError, DistributedPool, RankFailure, run_distributed

__all__ = ["DistributedError", "DistributedPool", "RankFailure", "run_distributed"]
