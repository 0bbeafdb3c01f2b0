"""Binding the daemon's Unix socket safely.

A path held by a live daemon is refused (we never steal another daemon's
socket); a stale one (nothing accepts on it) is replaced. The socket is
created with the configured mode and group so frontends in that group can
connect and nobody else can.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path


MAX_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one a NUL


class SocketBindError(RuntimeError):
    """The socket path cannot be served on (held by a live daemon, not a socket, bad group)."""


def _is_live(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()


def check_socket_path(path: Path) -> bool:
    """Raises SocketBindError when `path` cannot be served on; True when a stale socket is there.

    Cheap, so the daemon asks before loading its model, and again when it binds. A missing
    directory is made here (private; systemd's RuntimeDirectory sets its own), so a path that
    can never be bound fails now, in one line."""
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise SocketBindError(f"socket path {path} is too long: a Unix socket path has at most {MAX_PATH_BYTES} bytes")
    if not path.parent.is_dir():
        if path.parent.exists():
            raise SocketBindError(f"the socket's directory {path.parent} is not a directory")
        try:
            path.parent.mkdir(mode=0o700, parents=True)
        except OSError as e:
            raise SocketBindError(f"cannot make the socket's directory {path.parent}: {e.strerror}") from None
    if not (path.exists() or path.is_symlink()):
        return False
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise SocketBindError(f"{path} exists and is not a socket; refusing to replace it")
    if _is_live(path):
        raise SocketBindError(f"another daemon is serving on {path}")
    return True


def bind_unix_socket(path: Path, mode: int, group: str | None) -> socket.socket:
    if check_socket_path(path):
        path.unlink()  # stale: its daemon is gone
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # never a moment with wider permissions than asked
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            sock.close()
            path.unlink()
            raise SocketBindError(f"socket group {group!r} does not exist") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock
