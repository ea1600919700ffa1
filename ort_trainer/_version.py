"""The package version, in one place: the package exports it and the graph cache's keys read it."""

__version__ = "0.1.0"
"""The package's version."""


__all__ = ["__version__"]
