"""Default locations: where the socket and the state live when nobody says."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "kvtierd.sock"


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """`$RUNTIME_DIRECTORY/kvtierd.sock` (systemd's RuntimeDirectory=, first entry),
    else `$XDG_RUNTIME_DIR/kvtierd/kvtierd.sock`, else `/tmp/kvtierd-<uid>/kvtierd.sock`
    (a private directory). Empty variables count as unset."""
    env = os.environ if environ is None else environ
    runtime_directory = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime_directory:
        return Path(runtime_directory) / SOCKET_NAME
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvtierd" / SOCKET_NAME
    return Path(f"/tmp/kvtierd-{os.getuid()}") / SOCKET_NAME


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$STATE_DIRECTORY` (systemd's StateDirectory=), else `$XDG_STATE_HOME/kvtierd`,
    else `~/.local/state/kvtierd`."""
    env = os.environ if environ is None else environ
    state_directory = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state_directory:
        return Path(state_directory)
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    base = Path(env["XDG_STATE_HOME"]) if env.get("XDG_STATE_HOME") else home / ".local" / "state"
    return base / "kvtierd"
