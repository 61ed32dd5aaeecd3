"""The engine's version, in a module of its own so that any layer may read it without importing the API."""

__version__ = "0.1.0"
