"""kvtierctl compact against the real daemon: a hole left by an invalidation is packed, and what was
cached still hits."""

from __future__ import annotations

import json

from daemon_fixtures import wait_idle
from test_kvtierctl_daemon import ctl, ctl_json

from kvtierd.cli.metrics_view import Scrape

HEADERS = {"X-Kvtierd-Tenant": "compact-test"}


def messages(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Document {name}: " + "a paragraph about pages and caches. " * 8 + "Sum up."}]


def test_kvtierctl_compact_packs_the_pages_and_hits_still_hit(daemon, tmp_path):
    with daemon.client(**HEADERS) as c:
        def cached_tokens(name: str) -> int:
            r = c.post("/v1/chat/completions", json={"messages": messages(name), "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        for name in "abc":
            cached_tokens(name)
        hits = {name: cached_tokens(name) for name in "ac"}
        assert min(hits.values()) > 0
        wait_idle(c)
        b = tmp_path / "b.json"
        b.write_text(json.dumps(messages("b")))
        invalidated = ctl(daemon, "invalidate", "--messages-file", str(b), "--tenant", "compact-test")
        assert invalidated.returncode == 0, invalidated.stderr  # b's own pages: a hole between a's and c's

        data = ctl_json(daemon, "compact")
        before, after = data["before"], data["after"]
        assert before["free_runs"] >= 2 and data["pages_moved"] > 0
        assert data["bytes_moved"] > 0 and data["bytes_moved"] % data["pages_moved"] == 0 and data["ms"] >= 0
        assert after["free_runs"] == 1 and after["free_space_ratio"] == 0.0
        assert after["free_pages"] == before["free_pages"] and after["chained_pages"] == before["chained_pages"]
        assert after["sequence_ratio"] <= before["sequence_ratio"]
        table = ctl(daemon, "compact")  # nothing left to move
        assert table.returncode == 0 and not table.stderr
        assert table.stdout.startswith("moved 0 pages") and "0.0% -> 0.0%" in table.stdout, table.stdout

        assert {name: cached_tokens(name) for name in "ac"} == hits
        metrics = Scrape.parse(c.get("/metrics").text)
        assert metrics.value("kvtierd_compactions_total") >= 2
        assert metrics.value("kvtierd_compacted_pages_total") >= data["pages_moved"]
