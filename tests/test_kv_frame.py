"""The stored value frame: a chunk comes back exactly, or not at all."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from chunk_fixtures import TINY, make_identity, make_payload
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.storage.codecs import CODEC_NAMES
from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import ChunkIdentity, FrameExpectation, decode_frame, encode_frame, frame_nbytes
from kvtierd.storage.store_errors import CorruptValueError


def corrupt_check(frame: bytes, expected: FrameExpectation) -> str:
    with pytest.raises(CorruptValueError) as caught:
        decode_frame(frame, expected)
    return caught.value.check


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_round_trip(codec: str) -> None:
    identity = make_identity(pages=3)
    payload = make_payload(identity)
    frame = encode_frame(identity, payload, codec=codec)
    chunk = decode_frame(frame, identity)
    assert chunk.payload == payload
    assert chunk.codec == codec
    assert chunk.encoded_nbytes < len(frame)


def test_a_frame_names_its_namespace() -> None:
    identity = make_identity(namespace=b"model-a|alice")
    frame = encode_frame(identity, make_payload(identity))
    other = dataclasses.replace(identity, namespace=b"model-a|bob")
    assert corrupt_check(frame, other) == "namespace"


@pytest.mark.parametrize(
    "change",
    [{"num_layers": 3}, {"num_kv_heads": 2}, {"head_dim": 8}, {"dtype": torch.bfloat16}],
    ids=lambda c: next(iter(c)),
)
def test_a_frame_of_another_geometry_is_refused(change: dict) -> None:
    identity = make_identity()
    frame = encode_frame(identity, make_payload(identity))
    other = dataclasses.replace(identity, geometry=dataclasses.replace(TINY, **change))
    assert corrupt_check(frame, other) == "geometry"


def test_a_frame_of_another_block_size_is_refused() -> None:
    identity = make_identity()
    frame = encode_frame(identity, make_payload(identity))
    geometry = dataclasses.replace(TINY, block_size=2)
    other = ChunkIdentity(geometry, identity.namespace, identity.block_hashes, identity.token_ids[:4])
    assert corrupt_check(frame, other) == "geometry"


def test_token_ids_are_confirmed_so_a_hash_collision_serves_nothing() -> None:
    identity = make_identity()
    frame = encode_frame(identity, make_payload(identity))
    tokens = list(identity.token_ids)
    tokens[5] += 1
    collision = dataclasses.replace(identity, token_ids=tuple(tokens))
    assert corrupt_check(frame, collision) == "token ids"


def test_block_hashes_are_confirmed() -> None:
    identity = make_identity(pages=2)
    frame = encode_frame(identity, make_payload(identity))
    other = dataclasses.replace(identity, block_hashes=(identity.block_hashes[0], bytes(16)))
    assert corrupt_check(frame, other) == "block hashes"
    fewer = make_identity(pages=1)
    assert corrupt_check(frame, fewer) in {"block hashes", "token ids"}


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_flipped_byte_is_detected(codec: str) -> None:
    identity = make_identity(pages=2)
    frame = encode_frame(identity, make_payload(identity), codec=codec)
    for position in range(len(frame)):
        damaged = bytearray(frame)
        damaged[position] ^= 0xFF
        with pytest.raises(CorruptValueError):
            decode_frame(bytes(damaged), identity)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), codec=st.sampled_from(CODEC_NAMES))
def test_any_single_byte_change_is_detected(data: st.DataObject, codec: str) -> None:
    identity = make_identity(pages=2)
    frame = encode_frame(identity, make_payload(identity), codec=codec)
    position = data.draw(st.integers(0, len(frame) - 1))
    mask = data.draw(st.integers(1, 255))
    damaged = bytearray(frame)
    damaged[position] ^= mask
    with pytest.raises(CorruptValueError):
        decode_frame(bytes(damaged), identity)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_a_torn_frame_is_detected_at_every_length(codec: str) -> None:
    identity = make_identity(pages=2)
    frame = encode_frame(identity, make_payload(identity), codec=codec)
    for length in range(len(frame)):
        assert corrupt_check(frame[:length], identity) in {"truncated", "checksum", "payload"}
    assert corrupt_check(frame + b"\0", identity) == "truncated"


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_frame_nbytes_is_the_encoded_size(codec: str) -> None:
    identity = make_identity(pages=3)
    payload = make_payload(identity)
    frame = encode_frame(identity, payload, codec=codec)
    assert frame_nbytes(identity, codec, decode_frame(frame, identity).encoded_nbytes) == len(frame)


def test_not_a_frame() -> None:
    identity = make_identity()
    assert corrupt_check(b"PNG\0" + bytes(100), identity) == "magic"


def test_encode_refuses_a_payload_of_the_wrong_size() -> None:
    identity = make_identity()
    with pytest.raises(ValueError, match="payload has"):
        encode_frame(identity, make_payload(identity) + b"\0\0")


def test_identity_refuses_malformed_chunks() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        ChunkIdentity(TINY, b"ns", (), ())
    with pytest.raises(ValueError, match="one length"):
        ChunkIdentity(TINY, b"ns", (bytes(16), bytes(32)), tuple(range(8)))
    with pytest.raises(ValueError, match="token ids for"):
        ChunkIdentity(TINY, b"ns", (bytes(16),), tuple(range(5)))
    with pytest.raises(ValueError, match="32 bits"):
        encode_frame(ChunkIdentity(TINY, b"ns", (bytes(16),), (2**32, 0, 0, 0)), bytes(TINY.bytes_per_block))


geometries = st.builds(
    KVGeometry,
    num_layers=st.integers(1, 3),
    num_kv_heads=st.integers(1, 2),
    head_dim=st.integers(1, 8),
    block_size=st.integers(1, 4),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
)


@settings(max_examples=100, deadline=None)
@given(
    geometry=geometries,
    pages=st.integers(1, 3),
    hash_len=st.sampled_from([16, 32]),
    namespace=st.binary(max_size=40),
    codec=st.sampled_from(CODEC_NAMES),
    data=st.data(),
)
def test_round_trip_for_any_chunk(geometry: KVGeometry, pages: int, hash_len: int, namespace: bytes, codec: str,
                                  data: st.DataObject) -> None:
    hashes = tuple(data.draw(st.binary(min_size=hash_len, max_size=hash_len)) for _ in range(pages))
    tokens = tuple(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=pages * geometry.block_size,
                                      max_size=pages * geometry.block_size)))
    identity = ChunkIdentity(geometry, namespace, hashes, tokens)
    payload = data.draw(st.binary(min_size=identity.payload_nbytes, max_size=identity.payload_nbytes))
    assert decode_frame(encode_frame(identity, payload, codec=codec), identity).payload == payload
