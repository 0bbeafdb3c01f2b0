"""A model fingerprint: the namespace every cached KV page is keyed under.

Two daemons produce the same fingerprint only for the same weight bytes, loaded
in the same weight mode, with the same KV dtype and geometry, so KV written by
one can never be read under a different model (a bfloat16 KV chunk is never
served to a float32 engine, nor int8 weights' KV to float32 weights).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch

from kvtierd.model.config import ModelConfig


def digest_files(paths: Iterable[Path]) -> str:
    """SHA-256 over the files' names and bytes, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def model_fingerprint(weights_digest: str, config: ModelConfig, weight_mode: str, kv_dtype: torch.dtype) -> str:
    h = hashlib.sha256()
    h.update(weights_digest.encode())
    h.update(f"weights={weight_mode} kv={kv_dtype}".encode())
    h.update(repr(sorted(asdict(config).items())).encode())
    return h.hexdigest()[:32]
