"""Chunk payload codecs: exact round trips, and byte planes compress K/V better than plain zstd."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtierd.storage.codecs import CODEC_NAMES, SLICE_BYTES, get_codec
from kvtierd.storage.store_errors import CorruptValueError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def activations(n: int, dtype: torch.dtype, seed: int = 0) -> bytes:
    """K/V-like values: normal, small, in `dtype`, as the bytes a chunk carries."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.5
    return values.to(dtype).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_round_trip_on_kv_values(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    data = activations(16 * 16 * 64, dtype)
    encoded = codec.encode(data, dtype.itemsize)
    assert codec.decode(encoded, dtype.itemsize, len(data)) == data


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("nbytes", [0, 1, 2, 3, 5, 7, 4097])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_round_trip_on_empty_and_odd_sizes(name: str, nbytes: int, itemsize: int) -> None:
    codec = get_codec(name)
    data = os.urandom(nbytes)
    assert codec.decode(codec.encode(data, itemsize), itemsize, nbytes) == data


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codecs_take_any_buffer(name: str) -> None:
    data = activations(1000, torch.float16)
    codec = get_codec(name)
    for buffer in (bytearray(data), memoryview(data)):
        assert codec.decode(codec.encode(buffer, 2), 2, len(data)) == data


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_byte_planes_beat_plain_zstd_on_half_precision_activations(dtype: torch.dtype) -> None:
    data = activations(16 * 16 * 2 * 64, dtype, seed=1234)
    planes = len(get_codec("zstd-planes").encode(data, 2))
    plain = len(get_codec("zstd").encode(data, 2))
    assert planes < plain < len(data)


def test_byte_planes_beat_plain_zstd_on_float32_activations() -> None:
    data = activations(16 * 16 * 64, torch.float32, seed=1234)
    assert len(get_codec("zstd-planes").encode(data, 4)) < len(get_codec("zstd").encode(data, 4))


def test_codecs_are_shared_per_name_and_level() -> None:
    assert get_codec("zstd") is get_codec("zstd")
    assert get_codec("zstd", 3) is not get_codec("zstd", 1)
    assert get_codec("zstd", 3).level == 3


def test_unknown_codec_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        get_codec("lz4")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_payload_of_the_wrong_size_is_corrupt(name: str) -> None:
    codec = get_codec(name)
    data = activations(256, torch.float16)
    with pytest.raises(CorruptValueError) as caught:
        codec.decode(codec.encode(data, 2), 2, len(data) - 2)
    assert caught.value.check == "payload"


@pytest.mark.parametrize("name", ["zstd", "zstd-planes"])
def test_garbage_is_corrupt_not_a_crash(name: str) -> None:
    with pytest.raises(CorruptValueError):
        get_codec(name).decode(b"\x28\xb5\x2f\xfd garbage", 2, 100)


@pytest.mark.parametrize("name", ["zstd", "zstd-planes"])
def test_one_codec_serves_many_threads(name: str) -> None:
    codec = get_codec(name)
    inputs = [activations(4096, torch.float16, seed=s) for s in range(32)]

    def round_trip(data: bytes) -> bool:
        return codec.decode(codec.encode(data, 2), 2, len(data)) == data

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(round_trip, inputs))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decoding_calls_between_after_each_slice_of_its_work(name: str) -> None:
    """A paced load yields in `between`: a value of several slices calls it once a slice (of zstd's output, and of
    putting its byte planes back together), and decodes to the same bytes."""
    codec = get_codec(name)
    data = activations(3 * SLICE_BYTES // 2, torch.bfloat16)  # 3 slices of bytes
    calls: list[int] = []
    assert bytes(codec.decode(codec.encode(data, 2), 2, len(data), lambda: calls.append(1))) == data
    if name == "raw":
        assert not calls  # a view of the value: no work to slice
    else:
        assert len(calls) >= {"zstd": 3, "zstd-planes": 3 + 3}[name]
