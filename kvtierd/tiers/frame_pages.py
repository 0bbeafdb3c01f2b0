"""A stored frame's KV into device pages: checked, then copied (raw) or decoded first (another codec)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtierd.storage.codecs import Buffer
from kvtierd.storage.kv_frame import ChunkIdentity, check_frame_head, decode_frame
from kvtierd.storage.store_errors import CorruptValueError
from kvtierd.tiers.background_work import BACKGROUND_WORK
from kvtierd.tiers.page_copy import PageCopier

RAW_CODEC = "raw"


def scatter_frame(pages: PageCopier, value: torch.Tensor, identity: ChunkIdentity, skip: int,
                  block_ids: Sequence[int], decode: bool = False) -> str:
    """Checks a frame (a flat uint8 tensor) and writes its pages `skip`.. into `block_ids`: "ok", else the
    failed check's name. A raw payload is copied straight from `value`, each group of layers hashed right after
    the copy read it (one pass); another codec is decoded first, when `decode` allows it."""
    try:
        frame = check_frame_head(value.numpy(), identity)
    except CorruptValueError as e:
        return e.check
    if frame.codec == RAW_CODEC:  # viewed as bytes: a disk value's payload need not be aligned
        if len(frame.encoded) != identity.payload_nbytes:
            return "payload size"
        payload = value[frame.payload_offset : frame.payload_offset + identity.payload_nbytes]
        checksum = pages.scatter(payload.view(pages.byte_shape(identity.num_pages)), skip, block_ids, frame.encoded)
        return "ok" if checksum == frame.checksum else "checksum"
    if not decode:
        return "codec"
    try:
        chunk = decode_frame(value.numpy(), identity, BACKGROUND_WORK.pace)  # checks the payload's checksum itself
    except CorruptValueError as e:
        return e.check
    scatter_payload(pages, writable(chunk.payload), identity.num_pages, skip, block_ids)
    return "ok"


def scatter_payload(pages: PageCopier, payload: memoryview, num_pages: int, skip: int,
                    block_ids: Sequence[int]) -> None:
    """Writes pages `skip`.. of a decoded, checked payload (writable) into `block_ids`."""
    kv = torch.frombuffer(payload, dtype=torch.uint8)
    pages.scatter(kv.view(pages.byte_shape(num_pages)), skip, block_ids)


def writable(payload: Buffer) -> memoryview:
    """torch.frombuffer needs a writable buffer: a read-only one (a zstd payload, a remote value) is copied.
    A disk value is a bytearray already, and the raw codec decodes it to a view of itself."""
    view = memoryview(payload)
    return memoryview(bytearray(view)) if view.readonly else view


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())
