"""Pins below the device through the daemon: a prefix pinned in the disk tier is written there at once,
counted against the disk's pin budget, kept across a restart, and served from disk afterwards; a pin
over the host tier's budget is refused with a clear message."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
from pathlib import Path

from daemon_fixtures import Daemon, start_daemon

ENV = {"KVTIERD_HOST_BYTES": "64MiB", "KVTIERD_DISK_BYTES": "1GiB"}
USER = pwd.getpwuid(os.getuid()).pw_name  # a request's tenant: its peer's user
DOCUMENT = "Pinned notes on the disk tier: chunks, frames, checksums and the LRU that passes pins over. " * 14


def ctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtierd.cli.ctl", "--socket", str(daemon.socket), *args],
                          capture_output=True, text=True, timeout=300)


def pins(daemon: Daemon) -> dict:
    with daemon.client() as c:
        return c.get("/admin/pins").json()


def ask(daemon: Daemon) -> dict:
    with daemon.client() as c:
        r = c.post("/v1/completions", json={"prompt": DOCUMENT + "In short:", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_disk_pin_outlives_a_restart_and_a_host_pin_over_budget_is_refused():
    with tempfile.TemporaryDirectory(prefix="kvtierd-") as root:
        daemon = start_daemon(Path(root), env=ENV)
        try:
            done = ctl(daemon, "pin", "--text", DOCUMENT, "--tier", "disk", "--tenant", USER)
            assert done.returncode == 0, done.stderr
            assert "in the disk tier" in done.stdout and "pin budget used" in done.stdout
            listed = pins(daemon)
            (pin,) = listed["pins"]
            assert pin["tier"] == "disk" and pin["bytes"] > 0 and pin["pages"] == 0
            assert listed["disk"]["pinned_bytes"] == pin["bytes"] <= listed["disk"]["budget_bytes"]
            # 16 MiB of host budget (a quarter of 64 MiB) is less than this document's KV.
            refused = ctl(daemon, "pin", "--text", DOCUMENT * 3, "--tier", "host")
            assert refused.returncode != 0 and "over its pin budget" in refused.stderr, refused.stderr
            assert len(pins(daemon)["pins"]) == 1
            with daemon.client() as c:
                bad = c.post("/admin/pins", json={"text": DOCUMENT, "tier": "tape"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier"
        finally:
            assert daemon.stop() == 0, daemon.log_text()
        daemon = start_daemon(Path(root), env=ENV)  # the same state dir: SQL has the pin, LMDB its chunks
        try:
            (restored,) = pins(daemon)["pins"]
            assert (restored["id"], restored["tier"], restored["bytes"]) == (pin["id"], "disk", pin["bytes"])
            by_tier = ask(daemon)["kvtierd"]["cached_tokens_by_tier"]
            # From disk: loaded directly, or prefetched to the host tier as the request arrived.
            assert by_tier["disk"] + by_tier["host"] >= pin["num_tokens"] // 256 * 256, by_tier
            assert ctl(daemon, "unpin", pin["id"]).returncode == 0
            assert pins(daemon)["pins"] == [] and pins(daemon)["disk"]["pinned_bytes"] == 0
        finally:
            assert daemon.stop() == 0, daemon.log_text()
