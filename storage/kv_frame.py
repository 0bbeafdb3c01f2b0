"""The stored value frame: one chunk of N consecutive KV pages as it lives in a lower tier.

    header   <4s H I I I I I B Q Q>, little-endian:
             magic "KVTF", format version, num_layers, num_kv_heads, head_dim,
             block_size, num_pages, hash length, decoded payload bytes,
             xxh3_64 of the encoded payload
    dtype    u8 length + ascii ("float16")
    namespace u16 length + bytes
    codec    u8 length + ascii ("zstd-planes")
    hashes   num_pages x hash length bytes: the chained hash of each page
    tokens   num_pages x block_size x u32: the token ids of each page
    payload  u64 length + the encoded payload

The header has no checksum of its own: a reader compares every header field
with what it expects (`ChunkIdentity`), so a flipped header byte is a mismatch,
and a flipped payload byte fails the checksum. Either way the value is corrupt:
a miss for the caller, which quarantines it, never KV served to a request.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtierd.storage.codecs import DEFAULT_LEVEL, Between, Buffer, get_codec, no_pause
from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.store_errors import CorruptValueError

MAGIC = b"KVTF"
FORMAT_VERSION = 1

_HEADER = struct.Struct("<4sHIIIIIBQQ")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_TOKEN_BYTES = 4  # u32: every vocabulary fits


@dataclass(frozen=True, slots=True)
class ChunkIdentity:
    """What a chunk is: written into its frame, and checked against it on every read."""

    geometry: KVGeometry
    namespace: bytes  # model fingerprint and tenant: a value never crosses namespaces
    block_hashes: tuple[bytes, ...]  # one chained hash per page, in order; the last keys the chunk
    token_ids: tuple[int, ...]  # num_pages * block_size ids, page after page

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise ValueError("a chunk has at least one page")
        if len({len(h) for h in self.block_hashes}) != 1 or not 1 <= len(self.block_hashes[0]) <= 255:
            raise ValueError("block hashes must all have one length, 1 to 255 bytes")
        if len(self.token_ids) != len(self.block_hashes) * self.geometry.block_size:
            raise ValueError(
                f"{len(self.token_ids)} token ids for {len(self.block_hashes)} pages of {self.geometry.block_size}"
            )
        if len(self.namespace) > 0xFFFF:
            raise ValueError("namespace is longer than 65535 bytes")

    @property
    def num_pages(self) -> int:
        return len(self.block_hashes)

    @property
    def payload_nbytes(self) -> int:
        return self.num_pages * self.geometry.bytes_per_block

    def packed_token_ids(self) -> bytes:
        try:
            return struct.pack(f"<{len(self.token_ids)}I", *self.token_ids)
        except struct.error as e:
            raise ValueError(f"token ids must fit in 32 bits: {e}") from e


# A reader expects the identity it asked for; the name says which side it is on.
FrameExpectation = ChunkIdentity


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    payload: Buffer  # the K/V bytes, decoded: identity.payload_nbytes of them
    codec: str
    encoded_nbytes: int  # the payload's size in the frame, for compression stats


def encode_frame(identity: ChunkIdentity, payload: Buffer, *, codec: str = "zstd-planes",
                 level: int = DEFAULT_LEVEL) -> bytes:
    """Frames the chunk's K/V bytes (`identity.payload_nbytes` of them, in the tier manager's layout)."""
    nbytes = memoryview(payload).nbytes
    if nbytes != identity.payload_nbytes:
        raise ValueError(f"payload has {nbytes} bytes, the chunk's geometry needs {identity.payload_nbytes}")
    encoded = get_codec(codec, level).encode(payload, identity.geometry.dtype.itemsize)
    return frame_head(identity, codec, len(encoded), xxhash.xxh3_64_intdigest(encoded)) + encoded


def frame_head(identity: ChunkIdentity, codec: str, encoded_nbytes: int, checksum: int) -> bytes:
    """Everything of a frame before its encoded payload. Its length does not depend on `checksum`, so a
    writer may put the payload in place first and the head, with the payload's checksum, after."""
    g = identity.geometry
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, g.num_layers, g.num_kv_heads, g.head_dim, g.block_size,
        identity.num_pages, len(identity.block_hashes[0]), identity.payload_nbytes, checksum,
    )  # fmt: skip
    return b"".join((
        header,
        _short(_dtype_name(g).encode()),
        _U16.pack(len(identity.namespace)), identity.namespace,
        _short(codec.encode()),
        *identity.block_hashes,
        identity.packed_token_ids(),
        _U64.pack(encoded_nbytes),
    ))  # fmt: skip


def frame_nbytes(identity: ChunkIdentity, codec: str, encoded_nbytes: int) -> int:
    """The size of `identity`'s frame whose payload encodes to `encoded_nbytes` (for `raw`: payload_nbytes).
    The host tier sizes its slots with it."""
    return (_HEADER.size + _U8.size + len(_dtype_name(identity.geometry)) + _U16.size + len(identity.namespace)
            + _U8.size + len(codec) + identity.num_pages * len(identity.block_hashes[0])
            + len(identity.token_ids) * _TOKEN_BYTES + _U64.size + encoded_nbytes)


@dataclass(frozen=True, slots=True)
class CheckedFrame:
    """A frame whose head matched what the reader expected; its payload is not checked yet."""

    codec: str
    encoded: memoryview  # the encoded payload, a view into the caller's buffer
    payload_offset: int  # where `encoded` starts in the frame
    checksum: int  # xxh3_64 the encoded payload must have


def decode_frame(data: Buffer, expected: FrameExpectation, between: Between = no_pause) -> DecodedChunk:
    """Checks the frame against `expected` and decodes its payload (`between`: called between slices of the
    work, storage/codecs.py). Raises CorruptValueError naming the check."""
    frame = check_frame_head(data, expected)
    if xxhash.xxh3_64_intdigest(frame.encoded) != frame.checksum:
        raise CorruptValueError("checksum", "the payload's xxh3_64 differs from the frame's")
    between()
    g = expected.geometry
    payload = get_codec(frame.codec).decode(frame.encoded, g.dtype.itemsize, expected.payload_nbytes, between)
    return DecodedChunk(payload=payload, codec=frame.codec, encoded_nbytes=len(frame.encoded))


def check_frame_head(data: Buffer, expected: FrameExpectation) -> CheckedFrame:
    """Checks everything of a frame but its payload's checksum, which the caller must compare (the host
    tier hashes the payload while it copies it, in the same pass). Raises CorruptValueError."""
    f = _sections(data)
    g = expected.geometry
    found = (f.num_layers, f.num_kv_heads, f.head_dim, f.block_size, f.dtype)
    wanted = (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, _dtype_name(g).encode())
    if found != wanted:
        raise CorruptValueError("geometry", f"frame has {found}, expected {wanted}")
    if f.namespace != expected.namespace:
        raise CorruptValueError("namespace", "the frame belongs to another namespace")
    if f.num_pages != expected.num_pages or f.hashes != b"".join(expected.block_hashes):
        raise CorruptValueError("block hashes", f"the frame's {f.num_pages} page hashes differ from the chunk's")
    if f.tokens != expected.packed_token_ids():
        raise CorruptValueError("token ids", "the frame's token ids differ from the chunk's")
    if f.payload_nbytes != expected.payload_nbytes:
        raise CorruptValueError("payload size", f"{f.payload_nbytes} bytes, the geometry needs "
                                f"{expected.payload_nbytes}")
    try:
        name = f.codec.decode("ascii")
        get_codec(name)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptValueError("codec", f"unknown codec {f.codec!r}") from e
    return CheckedFrame(name, f.encoded, f.payload_offset, f.checksum)


def claimed_identity(data: Buffer, geometry: KVGeometry) -> ChunkIdentity:
    """The identity a frame says it has, read in `geometry`: for a reader that knows only the value's key
    (warming a tier from another). Nothing is checked but the frame's shape: `decode_frame` with this
    identity checks the rest, and the caller compares the key with the last block hash. Raises
    CorruptValueError."""
    f = _sections(data)
    if f.num_pages == 0 or f.hash_len == 0 or f.block_size != geometry.block_size:
        raise CorruptValueError("geometry", f"{f.num_pages} pages of {f.block_size} tokens, hashes of "
                                f"{f.hash_len} bytes")
    hashes = f.hashes.tobytes()
    return ChunkIdentity(geometry, f.namespace.tobytes(),
                         tuple(hashes[i : i + f.hash_len] for i in range(0, len(hashes), f.hash_len)),
                         struct.unpack(f"<{len(f.tokens) // _TOKEN_BYTES}I", f.tokens))


@dataclass(frozen=True, slots=True)
class _Sections:
    """A frame cut into its parts, unchecked (views into the caller's buffer)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_pages: int
    hash_len: int
    payload_nbytes: int
    checksum: int
    dtype: bytes
    namespace: memoryview
    codec: bytes
    hashes: memoryview
    tokens: memoryview
    payload_offset: int
    encoded: memoryview


def _sections(data: Buffer) -> _Sections:
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CorruptValueError("truncated", f"{len(view)} bytes is shorter than the {_HEADER.size}-byte header")
    (magic, version, num_layers, num_kv_heads, head_dim, block_size, num_pages, hash_len,
     payload_nbytes, checksum) = _HEADER.unpack_from(view)  # fmt: skip
    if magic != MAGIC:
        raise CorruptValueError("magic", f"{magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptValueError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
    reader = _Reader(view, _HEADER.size)
    dtype = reader.short().tobytes()
    namespace = reader.take(_U16.unpack(reader.take(_U16.size))[0])
    codec = reader.short().tobytes()
    hashes = reader.take(num_pages * hash_len)
    tokens = reader.take(num_pages * block_size * _TOKEN_BYTES)
    encoded_nbytes = _U64.unpack(reader.take(_U64.size))[0]
    payload_offset = reader.offset
    encoded = reader.take(encoded_nbytes)
    if reader.offset != len(view):
        raise CorruptValueError("truncated", f"{len(view) - reader.offset} bytes after the payload")
    return _Sections(num_layers, num_kv_heads, head_dim, block_size, num_pages, hash_len, payload_nbytes, checksum,
                     dtype, namespace, codec, hashes, tokens, payload_offset, encoded)


def _dtype_name(geometry: KVGeometry) -> str:
    return str(geometry.dtype).removeprefix("torch.")


def _short(text: bytes) -> bytes:
    return _U8.pack(len(text)) + text


class _Reader:
    """Walks the sections after the header; running past the end means a torn or mangled frame."""

    def __init__(self, view: memoryview, offset: int) -> None:
        self.view = view
        self.offset = offset

    def take(self, n: int) -> memoryview:
        if self.offset + n > len(self.view):
            raise CorruptValueError("truncated", f"a section of {n} bytes runs past the frame's end")
        part = self.view[self.offset : self.offset + n]
        self.offset += n
        return part

    def short(self) -> memoryview:
        return self.take(_U8.unpack(self.take(_U8.size))[0])
