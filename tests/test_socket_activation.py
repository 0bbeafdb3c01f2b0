"""Socket activation: the daemon serves on the socket systemd passed as fd 3 (kvtierd.socket).

The test plays systemd: it binds and listens on the socket itself, then starts
the daemon with the socket as fd 3 and LISTEN_PID/LISTEN_FDS naming it. A client
that connects before the model is loaded waits instead of being refused; the
daemon binds nothing of its own and leaves the socket file to its owner.
"""

from __future__ import annotations

import socket
import sys

from daemon_fixtures import wait_ready
from service_fixtures import spawn_daemon

# What systemd does between fork and exec: the socket at fd 3, and LISTEN_PID = the pid that execs kvtierd.
ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="kvtierd.socket")
os.execv(sys.argv[2], sys.argv[2:])
"""


def activate(listener: socket.socket) -> list[str]:
    return [sys.executable, "-c", ACTIVATE, str(listener.fileno())]


def test_daemon_serves_on_the_socket_it_was_passed(tmp_path):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    d = spawn_daemon(tmp_path, activate(listener), socket=path, pass_fds=[listener.fileno()])
    try:
        early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        early.connect(str(path))  # while the model loads: the kernel queues it, nobody refuses it
        early.sendall(b"GET /healthz HTTP/1.1\r\nHost: kvtierd\r\nConnection: close\r\n\r\n")
        early.settimeout(120)
        assert early.recv(4096).startswith(b"HTTP/1.1 200"), d.log_text()
        early.close()

        wait_ready(d)
        assert "(socket activation)" in d.log_text()
        assert not (tmp_path / "kvtierd.sock").exists()  # the --socket path: never bound
        assert d.stop() == 0, d.log_text()
        assert path.exists()  # systemd's socket file stays, and it still listens
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
            late.connect(str(path))
    finally:
        listener.close()
        if d.process.poll() is None:
            d.process.kill()
            d.process.wait()


def test_a_passed_socket_that_is_not_a_stream_is_refused_in_one_line(tmp_path):
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    datagram.bind(str(tmp_path / "dgram.sock"))
    d = spawn_daemon(tmp_path, activate(datagram), pass_fds=[datagram.fileno()])
    try:
        assert d.process.wait(60) == 1
        assert d.log_text().splitlines() == [
            "error: fd 3 from systemd is not a listening Unix stream socket (check ListenStream= in the .socket unit)"]
    finally:
        datagram.close()
