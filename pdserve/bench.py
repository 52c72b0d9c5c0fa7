"""``pdserve bench`` entry point; the implementation lives in :mod:`pdserve.benchlib`."""
from pdserve.benchlib.cli import main

__all__ = ["main"]
