"""The version of gradpipe (read by setuptools at build time; no importlib.metadata at import)."""

__version__ = "0.1.0"
