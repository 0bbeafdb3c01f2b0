"""Errors raised while loading a model or rendering its chat template."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model could not be loaded; the message says what to fix."""


class ModelNotFoundError(ModelLoadError):
    """The model file or directory does not exist."""


class UnsupportedModelError(ModelLoadError):
    """The model exists but uses a format or architecture kvtierd does not run."""


class ChatTemplateError(ValueError):
    """The chat template rejected the messages, or the model has no usable template."""
