"""The fp16lens release; ``fp16lens.__version__`` re-exports it and setup.cfg reads it there."""

__version__ = "0.1.0"
"""The release, as ``fp16lens.__version__`` and ``fp16lens --version`` show it."""
