"""The daemon under load while `/admin/tiers`, `/healthz` and `/metrics` are polled in a tight loop (a bounded
number of times): every poll answers 200, every request completes, and the daemon logs no exception. Those
handlers read a snapshot taken between steps, or go through the engine's thread: never live structures the
step thread is changing."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from daemon_fixtures import start_daemon

POLLS = 40  # per endpoint
STREAMS = 2
DOC = "Notes on pages, chunks and tiers: the device holds pages, the host slab and the disk hold chunks. " * 12


def test_polling_the_admin_endpoints_under_load_never_fails():
    with tempfile.TemporaryDirectory(prefix="kvtpl-") as root:
        # A small device pool: the streams' pages are evicted to the host and disk tiers while the polls run.
        d = start_daemon(Path(root), env={"KVTIERD_KV_CACHE_BYTES": "32MiB", "KVTIERD_DISK_ADMISSION": "all",
                                          "KVTIERD_QOS_MAX_QUEUE_S": "high=0,normal=0,low=0"})
        statuses: dict[str, list[int]] = {}
        errors: list[str] = []

        def stream(i: int) -> None:
            with d.client() as c:
                for turn in range(2):
                    body = {"messages": [{"role": "user", "content": f"{DOC} Question {i}.{turn}: summarise."}],
                            "max_tokens": 8, "temperature": 0, "session_id": f"poll-{i}"}
                    r = c.post("/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        errors.append(f"chat {r.status_code}: {r.text[:200]}")

        def poll(path: str) -> None:
            with d.client() as c:
                statuses[path] = [c.get(path).status_code for _ in range(POLLS)]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        threads += [threading.Thread(target=poll, args=(p,)) for p in ("/admin/tiers", "/healthz", "/metrics")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert d.stop() == 0
        log = d.log_text()
    assert not errors
    assert {p: set(s) for p, s in statuses.items()} == {p: {200} for p in ("/admin/tiers", "/healthz", "/metrics")}
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
