"""Errors a user can cause while choosing or loading a model."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model could not be loaded for a reason the user can fix (path, file, architecture).

    Entry points print its message instead of a traceback.
    """
