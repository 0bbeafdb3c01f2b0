"""The daemon on PostgreSQL: a session outlives its daemon and continues on another one."""

from __future__ import annotations

import tempfile
from pathlib import Path

from daemon_fixtures import start_daemon


def test_a_session_continues_on_a_second_daemon_sharing_the_store(postgres_server):
    url = postgres_server.create_database("kvtierd_daemons")
    env = {"KVTIERD_STORE_URL": url}
    with tempfile.TemporaryDirectory(prefix="kvtpg-") as root:
        first = start_daemon(Path(root) / "a", env=env)
        try:
            with first.client() as c:
                sid = c.post("/v1/sessions", json={"system_prompt": "You are terse."}).json()["id"]
                r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Name a colour.", "max_tokens": 8,
                                                                 "temperature": 0})
                assert r.status_code == 200
                first_reply = r.json()["choices"][0]["message"]["content"]
        finally:
            assert first.stop() == 0
        second = start_daemon(Path(root) / "b", env=env)  # another socket and state dir: another "host"
        try:
            with second.client() as c:
                r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Another one.", "max_tokens": 8,
                                                                 "temperature": 0})
                assert r.status_code == 200
                messages = c.get(f"/v1/sessions/{sid}").json()["messages"]
        finally:
            assert second.stop() == 0
    assert [m["content"] for m in messages[:2]] == ["Name a colour.", first_reply]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert all(m["status"] == "complete" for m in messages)
