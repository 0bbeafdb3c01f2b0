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


def test_with_postgres_down_chats_go_on_sessions_get_a_clear_503_and_it_recovers_without_restart(postgres_server):
    env = {"KVTIERD_STORE_URL": postgres_server.create_database("kvtierd_outage")}
    turn = {"max_tokens": 4, "temperature": 0}
    with tempfile.TemporaryDirectory(prefix="kvtpg-") as root:
        d = start_daemon(Path(root) / "a", env=env)
        try:
            with d.client() as c:
                sid = c.post("/v1/sessions", json={}).json()["id"]
                assert c.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", **turn}).status_code == 200
                postgres_server.stop()
                try:
                    stateless = c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Still there?"}], **turn})
                    assert stateless.status_code == 200  # no store needed: served
                    refused = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Lost?", **turn})
                    assert refused.status_code == 503 and "Retry-After" in refused.headers
                    assert "session store" in refused.json()["error"]["message"]
                    assert c.get(f"/v1/sessions/{sid}").status_code == 503
                finally:
                    postgres_server.start()
                again = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Back?", **turn})
                assert again.status_code == 200, again.text
                messages = c.get(f"/v1/sessions/{sid}").json()["messages"]
                assert [m["content"] for m in messages if m["role"] == "user"] == ["Hi", "Back?"]
        finally:
            assert d.stop() == 0
