"""A real `kvtierd serve` process on a temporary socket, and clients for it.

`start_daemon` runs the installed entry point exactly as an operator would and
waits until /healthz answers; `Daemon.stop` sends SIGTERM and waits for exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from waiting import HANG_GUARD_S, wait_until


@dataclass
class Daemon:
    process: subprocess.Popen
    socket: Path
    state_dir: Path
    log: Path

    def client(self, **headers: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://kvtierd",
                            headers=headers, timeout=120)

    def async_client(self, **headers: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)), base_url="http://kvtierd",
                                 headers=headers, timeout=120)

    def openai(self, **headers: str):
        from openai import OpenAI

        return OpenAI(base_url="http://kvtierd/v1", api_key="unused", default_headers=headers or None,
                      http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=120))

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def log_text(self) -> str:
        return self.log.read_text()


# Where a request's KV comes from is what the daemon tests check, not how long its lookup of the lower tiers may
# take: a busy machine answered a lookup later than a tenth of a short prompt's recompute estimate (the default),
# and the request recomputed. A share the lookups of a loaded machine never reach (tests/test_transfers_engine.py
# checks the share itself, on a clock it moves).
LOOKUP_WAIT_SHARE = "1000"


def start_daemon(root: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    sock, state, log = root / "kvtierd.sock", root / "state", root / "daemon.log"
    cmd = [sys.executable, "-m", "kvtierd.cli.main", "serve", "--socket", str(sock), "--state-dir", str(state), *args]
    # float32 weights: the daemon tests assert exact equality (across restarts, tiers, chunked prefill).
    full_env = {**os.environ, "KVTIERD_KV_CACHE_BYTES": "256MiB", "KVTIERD_DTYPE": "float32",
                "KVTIERD_LOOKUP_WAIT_SHARE": LOOKUP_WAIT_SHARE, **(env or {})}
    process = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full_env)
    daemon = Daemon(process, sock, state, log)
    if wait:
        wait_ready(daemon)
    return daemon


def wait_ready(daemon: Daemon, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"kvtierd exited with {daemon.process.returncode}:\n{daemon.log_text()}")
        if daemon.socket.exists():
            try:
                with daemon.client() as c:
                    if c.get("/healthz").status_code == 200:
                        return
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    daemon.stop()
    raise RuntimeError(f"kvtierd did not become ready in {timeout} s:\n{daemon.log_text()}")


@pytest.fixture(scope="session")
def daemon():
    """One daemon shared by the API tests (short Unix socket path: sun_path is ~107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        d = start_daemon(Path(root))
        yield d
        assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def lookups_waited():
    """The daemons a bench starts (they inherit the environment) wait for their lookups as start_daemon's do."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIERD_LOOKUP_WAIT_SHARE", LOOKUP_WAIT_SHARE)
        yield


def engine_status(c: httpx.Client) -> dict:
    return c.get("/admin/status").json()["engine"]


def wait_idle(c: httpx.Client) -> dict:
    """Polls /admin/status until no request runs or waits and no page is held; returns the engine's status."""

    def idle() -> dict | None:
        e = engine_status(c)
        return e if e["used_blocks"] == 0 and e["running"] == 0 and e["waiting"] == 0 else None

    return wait_until(idle, "the engine going idle (no request running or waiting, no page held)")
