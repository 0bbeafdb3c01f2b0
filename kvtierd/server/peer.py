"""Who is on the other end of the socket: SO_PEERCRED, mapped to a tenant and a role.

The tenant is the peer's user name (or `uid-N` without a passwd entry). Root
and members of the admin group may use /admin routes and, as trusted
frontends, name the tenant of a request in a header.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int
    user: str
    is_admin: bool


# Cached: a group change is seen after a restart, like a login session's groups.
@functools.lru_cache(maxsize=256)
def _user_and_groups(uid: int, gid: int) -> tuple[str, frozenset[int]]:
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid-{uid}", frozenset({gid})
    return name, frozenset(os.getgrouplist(name, gid))


def peer_of(sock: socket.socket, admin_group: str | None) -> Peer:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    user, groups = _user_and_groups(uid, gid)
    admin_gid = _gid_of(admin_group) if admin_group else None
    return Peer(pid, uid, gid, user, uid == 0 or (admin_gid is not None and admin_gid in groups))


@functools.lru_cache(maxsize=8)
def _gid_of(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None
