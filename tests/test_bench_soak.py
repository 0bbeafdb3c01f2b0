"""`kvtierd bench soak` against the shared daemon: hang-ups and bad requests leave nothing behind."""

from __future__ import annotations

from kvtierd.bench.soak_bench import daemon_pid, rss_bytes, run_soak_bench


def test_the_daemon_pid_comes_from_its_socket(daemon):
    assert daemon_pid(daemon.socket) == daemon.process.pid
    assert rss_bytes(daemon.process.pid) > 50 * 2**20


def test_a_short_soak_leaves_no_page_in_use_and_no_5xx(daemon):
    f = run_soak_bench(daemon.socket, sessions=4, rounds=2, concurrency=4, max_tokens=6, disconnect_p=0.5, seed=1)
    outcomes = f["outcomes"]
    # Per round: 4 session turns (served or cut off), 2 stateless chats, 1 bad request.
    assert f["requests"] == 2 * 7
    assert outcomes["refused (4xx)"] == 2
    assert outcomes.get("served", 0) + outcomes.get("cut off by the client", 0) == 2 * 6
    assert outcomes.get("cut off by the client", 0) > 0
    assert f["errors_5xx"] == 0 and f["pages_back_to_baseline"]
