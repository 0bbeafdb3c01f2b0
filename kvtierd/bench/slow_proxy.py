"""A TCP proxy on loopback that holds each call `delay_ms` before passing it to the server (the first bytes a
client sends after the server last answered it; a large value sent in many reads is held once), for
`kvtierd bench stall`'s slow Redis. It runs as a process of its own, and relays with splice(2) through a pipe,
so the bytes never enter it: a far Redis costs the host its network stack's work, not a relay's. Read into
the process and written out again (asyncio, 64 KiB at a time), eight of the bundled model's chunks (96 MB)
took the relay 162 ms of CPU, on the two cores whose steps the bench times; spliced, 22 ms (a probe).

    python -m kvtierd.bench.slow_proxy TARGET_PORT DELAY_MS    (prints the port it listens on, then serves)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
import time

PIPE_BYTES = 1 << 20  # what one splice moves at most


def _pump(src: socket.socket, dst: socket.socket, answered: threading.Event, delay_s: float | None) -> None:
    """Moves src's bytes to dst. Upstream (`delay_s` given): a call's first bytes wait `delay_s` in the pipe."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):  # past the system's pipe-max-size: the default 64 KiB, more calls
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    try:
        while n := os.splice(src.fileno(), write_end, PIPE_BYTES, flags=os.SPLICE_F_MOVE):
            if delay_s is None:
                answered.set()
            elif answered.is_set():
                answered.clear()
                time.sleep(delay_s)
            while n:
                n -= os.splice(read_end, dst.fileno(), n, flags=os.SPLICE_F_MOVE)
    except OSError:
        pass
    finally:
        os.close(read_end)
        os.close(write_end)
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(client: socket.socket, target_port: int, delay_s: float) -> None:
    try:
        server = socket.create_connection(("127.0.0.1", target_port))
    except OSError:
        client.close()
        return
    answered = threading.Event()  # the server answered since the client last sent: its next bytes are a new call
    answered.set()
    for src, dst, delay in ((client, server, delay_s), (server, client, None)):
        threading.Thread(target=_pump, args=(src, dst, answered, delay), daemon=True).start()


def main(target_port: int, delay_s: float) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        _serve(client, target_port, delay_s)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) / 1e3)
