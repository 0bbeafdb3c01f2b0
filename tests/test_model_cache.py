"""The converted-model cache on real files (the default weight mode's): a cached load equals a GGUF load
(weights bit for bit, the tokenizer id for id, the fingerprint), a damaged entry is converted again, a
changed file misses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvtierd.model.bundled import bundled_gguf_path
from kvtierd.model.loader import LoadedModel, load_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Pages of 16 tokens, 3 <|im_end|>?"}]


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    assert (a.fingerprint, a.config, a.name) == (b.fingerprint, b.config, b.name)
    ta, tb = a.model.weights.named_tensors(), b.model.weights.named_tensors()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    w = b.model.weights
    assert ((w.lm_head_exact if w.lm_head_exact is not None else w.lm_head) is w.embed) == a.config.tie_word_embeddings
    ta_, tb_ = a.tokenizer, b.tokenizer
    assert ta_.encode_chat(MESSAGES) == tb_.encode_chat(MESSAGES)
    assert (ta_.eos_token_id, ta_.eos_token_ids, ta_.bos_token_id, ta_.add_bos, ta_.special_token_ids) == \
        (tb_.eos_token_id, tb_.eos_token_ids, tb_.bos_token_id, tb_.add_bos, tb_.special_token_ids)
    assert ta_.chat_template == tb_.chat_template


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    cache = tmp_path_factory.mktemp("model-cache")
    return load_model(cache_dir=cache), cache


def test_a_cached_load_equals_the_gguf_load(converted) -> None:
    first, cache = converted
    (entry,) = cache.iterdir()
    assert {p.name for p in entry.iterdir()} == {"weights.safetensors", "model.json"}
    assert_same_model(load_model(), first)  # no cache: the GGUF path itself
    assert_same_model(first, load_model(cache_dir=cache))


def test_a_damaged_entry_is_converted_again(converted, caplog) -> None:
    first, cache = converted
    (entry,) = cache.iterdir()
    weights = entry / "weights.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])  # cut short
    again = load_model(cache_dir=cache)
    assert "unreadable" in caplog.text
    assert_same_model(first, again)
    assert list(cache.iterdir()) == [entry] and weights.stat().st_size == size  # made again, whole


def test_another_file_does_not_meet_the_entry(converted, tmp_path: Path) -> None:
    _, cache = converted
    other = tmp_path / "copy.gguf"
    shutil.copyfile(bundled_gguf_path(), other)
    with other.open("ab") as f:
        f.write(b"\0" * 32)  # GGUF readers ignore trailing bytes; the digest does not
    load_model(other, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2
