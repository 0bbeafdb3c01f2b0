"""A cache of converted GGUF models, so that a restart maps the weights instead of converting them again.

Reading a GGUF file takes seconds on a CPU: gguf's reader walks every metadata string (the vocabulary
and merges are 100,000 of them) and the quantized tensors are dequantized. The cache keeps the result:

    <cache_dir>/<digest of the weights>-<weight mode>/
        weights.safetensors   the fused tensors as the forward uses them (a quantized matrix as
                              <name>.packed, <name>.scales and <name>.dense)
        model.json            format version, the ModelConfig, the tokenizer's state

An entry is written into a temporary directory and renamed into place, so a reader finds it whole or
not at all. Its name holds the SHA-256 of the GGUF's bytes (the fingerprint's digest), so a changed file
never meets an old entry. An entry that cannot be read is removed and made again from the GGUF.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvtierd.model.config import ModelConfig, RopeScaling
from kvtierd.model.quantized import QuantizedLinear
from kvtierd.model.tokenizer import ChatTokenizer
from kvtierd.model.weight_modes import WeightMode
from kvtierd.model.weights import LayerWeights, Matrix, ModelWeights, plain

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: norms float32 in every mode; quantized modes: float32 embedding, exact LM head rows
# 3: a quantized mode's LM head in the mode's own kind (int4 too)
LAYER_FIELDS = ("attn_norm", "qkv", "qkv_bias", "o", "ffn_norm", "gate_up", "down")


class ModelCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, digest: str, mode: WeightMode,
            device: torch.device) -> tuple[ModelConfig, ModelWeights, ChatTokenizer] | None:
        """The cached conversion, on `device`; None when there is none (or it was unreadable: then it is gone)."""
        entry = self._entry(digest, mode)
        if not entry.is_dir():
            return None
        try:
            meta = json.loads((entry / "model.json").read_text(encoding="utf-8"))
            if meta["format_version"] != FORMAT_VERSION:
                raise ValueError(f"format version {meta['format_version']}, this build reads {FORMAT_VERSION}")
            config = _config(meta["config"])
            tensors = load_file(entry / "weights.safetensors", device=str(device))
            weights = _weights(tensors, config, mode)
            tokenizer = ChatTokenizer.from_state(meta["tokenizer"])
        except Exception as e:  # any damage means convert again: the GGUF is the source of truth
            log.warning("converted-model cache entry %s is unreadable (%s): removed, converting the model again",
                        entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return config, weights, tokenizer

    def put(self, digest: str, mode: WeightMode, config: ModelConfig, weights: ModelWeights,
            tokenizer: ChatTokenizer) -> None:
        """Stores a conversion; a failure (disk full, no permission) is logged, never raised."""
        entry = self._entry(digest, mode)
        tmp: Path | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.directory, prefix=".tmp-"))
            save_file(_tensors(weights, config), tmp / "weights.safetensors")
            meta = {"format_version": FORMAT_VERSION, "config": asdict(config), "tokenizer": tokenizer.state()}
            (tmp / "model.json").write_text(json.dumps(meta), encoding="utf-8")
            os.rename(tmp, entry)  # whole or not at all
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if not entry.is_dir():  # else another daemon's conversion got there first
                log.warning("cannot cache the converted model in %s: %s", self.directory, e)

    def _entry(self, digest: str, mode: WeightMode) -> Path:
        return self.directory / f"{digest[:32]}-{mode.name}"


def _tensors(weights: ModelWeights, config: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {"embed": weights.embed, "final_norm": weights.final_norm}

    def add(name: str, t: Matrix | None) -> None:
        if isinstance(t, QuantizedLinear):
            out.update({f"{name}.packed": t.packed, f"{name}.scales": t.scales, f"{name}.dense": plain(t.dense)})
        elif t is not None:
            out[name] = plain(t)

    if weights.lm_head is not weights.embed:
        add("lm_head", weights.lm_head)
    if weights.lm_head_exact is not None and weights.lm_head_exact is not weights.embed:
        out["lm_head_exact"] = weights.lm_head_exact
    for i, layer in enumerate(weights.layers):
        for name in LAYER_FIELDS:
            add(f"layers.{i}.{name}", getattr(layer, name))
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def _weights(tensors: dict[str, torch.Tensor], config: ModelConfig, mode: WeightMode) -> ModelWeights:
    def get(name: str, kind: str | None = mode.quantization) -> Matrix | None:
        if f"{name}.packed" in tensors:
            assert kind is not None, f"{name} is quantized in a {mode.name} entry"
            return QuantizedLinear(kind, tensors[f"{name}.packed"], tensors[f"{name}.scales"], tensors[f"{name}.dense"])
        return tensors.get(name)

    layers = [LayerWeights(**{name: get(f"layers.{i}.{name}") for name in LAYER_FIELDS})
              for i in range(config.num_layers)]
    embed = tensors["embed"]
    lm_head = get("lm_head")
    exact = tensors.get("lm_head_exact", embed) if mode.quantization else None
    return ModelWeights(embed=embed, layers=layers, final_norm=tensors["final_norm"],
                        lm_head=embed if lm_head is None else lm_head, lm_head_exact=exact)


def _config(fields: dict) -> ModelConfig:
    scaling = fields.pop("rope_scaling")
    return ModelConfig(**fields, rope_scaling=None if scaling is None else RopeScaling(**scaling))
