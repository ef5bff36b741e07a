"""The former name of train/parallelize.py's `parallelize`, kept while callers move to it."""

from megapipe.train.parallelize import Job, replica
from megapipe.train.parallelize import parallelize as build

__all__ = ["Job", "build", "replica"]
