"""Layers import only downward (docs/ARCHITECTURE.md): a new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "kvtierd": ROOT / "kvtierd",
    "kvtierd.kernels": ROOT / "kernels",
    "kvtierd.storage": ROOT / "storage",
    "kvtierd.migrations": ROOT / "migrations",
}
# Each layer and the layers it may import (besides itself).
ALLOWED = {
    "cli": {"server", "engine", "cache", "tiers", "storage", "model", "kernels", "bench", "migrations"},
    "bench": {"engine", "cache", "tiers", "storage", "model", "kernels"},
    "server": {"engine", "cache", "tiers", "storage", "model", "kernels", "migrations"},
    "engine": {"cache", "tiers", "storage", "model", "kernels"},
    "cache": {"tiers", "storage"},
    "tiers": {"storage"},
    "storage": {"migrations"},
    "migrations": {"storage"},
    "model": {"kernels"},
    "kernels": set(),
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvtierd" and len(parts) > 1 else None


def modules():
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if package == "kvtierd":
                yield path, layer_of("kvtierd." + ".".join(rel.parts))
            else:
                yield path, package.split(".")[1]


def test_every_module_belongs_to_a_known_layer():
    for path, layer in modules():
        assert layer in ALLOWED or path.name == "__init__.py", f"{path} is in no layer"


def test_layers_import_only_downward():
    bad = []
    for path, layer in modules():
        if layer is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in ("kernels", "storage", "migrations"):
                    bad.append(f"{path}: imports {name}; use kvtierd.{name}")
                target = layer_of(name)
                if target and target != layer and target not in ALLOWED[layer]:
                    bad.append(f"{path}: {layer} imports {name} ({target} is not below it)")
    assert not bad, "\n".join(bad)
