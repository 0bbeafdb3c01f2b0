"""The remote tier's keyspace: what a value's meaning depends on besides its chunk key.

    kvtierd:v1:<fleet>:<model fingerprint>:<geometry>:n<chunk pages>:f<frame version>:

Daemons agree on a value only when all of it is equal, so two models, two
geometries, two chunk sizes or two fleets never read each other's values
(`decode_frame` would refuse them anyway, but as corrupt values, deleted on
sight: hosts of two kinds would wipe each other's chunks). The chunk key after
the prefix already carries the tenant's namespace (the chain's root).

The codec is not in the key: a frame names its codec and every reader decodes
every codec, so hosts with other codec settings still share values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtierd.storage.geometry import KVGeometry
from kvtierd.storage.kv_frame import FORMAT_VERSION
from kvtierd.storage.store_errors import StoreArgumentError

KEY_SCHEMA = "v1"  # this layout of the prefix
# No ':' (the separator), and no '{': a hash tag would put every key of the tier in one Cluster slot.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True, slots=True)
class RedisKeyspace:
    fleet: str  # the daemons that share values (one Redis may serve several fleets)
    model_fingerprint: str  # kvtierd.model.fingerprint: weights, dtype and config
    geometry: KVGeometry
    chunk_pages: int  # chunk j holds pages [jN, (j+1)N): under another N the same key names another chunk
    frame_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for field, value in (("fleet", self.fleet), ("model_fingerprint", self.model_fingerprint)):
            if not _NAME.fullmatch(value):
                raise StoreArgumentError(f"{field} {value!r} must be 1 to 64 of A-Z a-z 0-9 . _ -")
        if self.chunk_pages < 1:
            raise StoreArgumentError(f"chunk_pages must be at least 1, got {self.chunk_pages}")

    @property
    def key_prefix(self) -> str:
        g = self.geometry
        shape = f"{g.num_layers}x{g.num_kv_heads}x{g.head_dim}x{g.block_size}-{str(g.dtype).removeprefix('torch.')}"
        return (f"kvtierd:{KEY_SCHEMA}:{self.fleet}:{self.model_fingerprint}:{shape}"
                f":n{self.chunk_pages}:f{self.frame_version}:")
