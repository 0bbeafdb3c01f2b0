"""Socket activation (sd_listen_fds(3)): serving on the socket systemd opened for us.

systemd (kvtierd.socket) binds and listens, then starts the daemon with the
socket as fd 3 and LISTEN_PID/LISTEN_FDS saying so. Clients can connect while
the model loads or the daemon restarts, and the daemon needs no rights over
the socket's directory. systemd owns the socket file: the daemon never unlinks it.
"""

from __future__ import annotations

import os
import socket

from kvtierd.server.unix_socket import SocketBindError

SD_LISTEN_FDS_START = 3


def take_listen_socket() -> socket.socket | None:
    """The Unix stream socket systemd passed us, or None when we were not socket-activated.

    The LISTEN_* variables are meant for this process only: they are removed, so
    nothing we spawn takes them for its own."""
    pid, fds = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    if pid != str(os.getpid()) or not fds.isdigit() or int(fds) < 1:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    problem = f"fd {SD_LISTEN_FDS_START} from systemd is not a listening Unix stream socket (check ListenStream= in the .socket unit)"
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)  # family and type are read from the fd
    except OSError:
        raise SocketBindError(problem) from None
    if (sock.family, sock.type) != (socket.AF_UNIX, socket.SOCK_STREAM) or not sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.close()
        raise SocketBindError(problem)
    sock.set_inheritable(False)  # systemd hands it over inheritable; our children have no use for it
    sock.setblocking(False)
    return sock
