"""kvtierd: a KV-cache daemon for LLM inference."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtierd")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
