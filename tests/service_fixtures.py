"""`kvtierd serve` started the way systemd starts it: behind a wrapper command, with inherited fds.

`start_daemon` (daemon_fixtures.py) runs the daemon itself; here a wrapper
(socket activation's fd shuffle, a seccomp filter) runs first and execs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from daemon_fixtures import Daemon

SERVE = [sys.executable, "-m", "kvtierd.cli.main", "serve"]


def spawn_daemon(root: Path, wrapper: Sequence[str], *args: str, socket: Path | None = None,
                 pass_fds: Sequence[int] = ()) -> Daemon:
    """Starts `wrapper... python -m kvtierd.cli.main serve --socket S --state-dir D args...` under `root`.

    `socket` is where clients connect, when that is not the --socket path (socket activation)."""
    sock, state, log = root / "kvtierd.sock", root / "state", root / "daemon.log"
    cmd = [*wrapper, *SERVE, "--socket", str(sock), "--state-dir", str(state), *args]
    env = {**os.environ, "KVTIERD_KV_CACHE_BYTES": "256MiB", "KVTIERD_DTYPE": "float32"}  # as start_daemon
    process = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, pass_fds=pass_fds)
    return Daemon(process, socket or sock, state, log)
