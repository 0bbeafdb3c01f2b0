"""The disk tier's name in the SQL chunk catalog: this host's name and an id kept beside the store.

Daemons that share one PostgreSQL each reconcile only their own disk store's rows, so the name must be
unique to a store: host names repeat across containers, and so do state directory paths. The id is
made at random when the store is first used and kept in `<kv dir>/store_id` (write, fsync, rename).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def disk_store_name(directory: Path) -> str | None:
    """`<host name>:<id>` for the store in `directory`; None when its id can be neither read nor made."""
    path = directory / "store_id"
    try:
        store_id = path.read_text().strip()
    except FileNotFoundError:
        store_id = secrets.token_hex(8)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(store_id)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot keep the disk KV store's id in %s: %s (its sessions are not cataloged)", path, e)
            return None
    except OSError as e:
        log.warning("cannot read the disk KV store's id in %s: %s (its sessions are not cataloged)", path, e)
        return None
    return f"{socket.gethostname()}:{store_id}"
